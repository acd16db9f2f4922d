"""Training-time test (TTT): unroll the draft over K steps, each fed its own previous output.

Slots and targets. For a sequence x_0..x_{T-1} with target features f_0..f_{T-1}, slot t of
step k stands for the draft after context x_0..x_t having drafted k tokens already:
- step 0, slot t: feature f_t, token x_{t+1}, RoPE position t, predicts x_{t+2};
- step k, slot t: feature = step k-1's output hidden at slot t (eagle3, mtp `chain`) or
  f_t (mtp `target`); token = the draft's own argmax of step k-1 at slot t, mapped to a
  target id through d2t (`token_feed="draft"`), or the data token x_{t+k+1}
  (`token_feed="data"`, teacher forcing); RoPE position t + k; predicts x_{t+k+2}.
The teacher of step k at slot t is the target's distribution at position t+k+1; the
position counts when loss_mask[t+k+2] is set (so slots whose label lies past the end
are dropped).

Attention mask (eagle3 and eagle, one layer shared by every step): the query of step k at
slot t attends to
  * step 0's keys at slots s <= t (the context, as the target saw it), and
  * step j's key at slot t itself, for 1 <= j <= k (its own earlier drafts: the diagonal).
This is exactly the draft's view at inference after context 0..t; `TTTCache` computes it
without materialising the (k+1)T-wide mask, and tests check it against the dense 4D mask
through a DynamicCache. mtp: layer k is its own layer and attends causally to its own
step's keys (slots s <= t), as DeepSeek-V3's MTP modules do.

A head that drafts a whole block in one forward (`drafts_block`: dflash) is not unrolled: its
`training_logits` give every step at once (step k at slot t is mask slot k+1 of the block anchored
at x_{t+1}, so it predicts x_{t+k+2} too), and `_block_scores` scores them as the steps are scored.

Gradients flow through the fed hidden state (step k's loss reaches the weights through
steps 0..k-1); the fed token is an argmax and carries none.

Activation checkpointing (`checkpoint_steps`, recipe key `train.checkpoint_unroll`): each step,
its lm_head and its loss run under `torch.utils.checkpoint` (non-reentrant) and are recomputed in
the backward, so the unroll keeps per step only its inputs and outputs (feature, hidden, the
step's keys/values) instead of its MLP, logits and loss activations; about one more forward
per step. A step sees the cache as it was when the step first ran (a snapshot) and hands its new
keys/values back as outputs (`cached_step`), so the recomputation attends to exactly the same blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eyas.draft.blocks import TTTCache
from eyas.draft.head import DraftHead
from eyas.draft.registry import head_class
from eyas.train.losses import Teacher, TeacherDist, step_losses

TOKEN_FEEDS = ("draft", "data")


@dataclass
class UnrollResult:
    """Per-step sums over valid positions; the caller normalises (global counts under DDP)."""

    loss_sums: list[torch.Tensor] = field(default_factory=list)  # weighted by loss_mask, with grad
    counts: list[torch.Tensor] = field(default_factory=list)     # sum of loss_mask over valid positions
    correct: list[torch.Tensor] = field(default_factory=list)    # draft argmax == teacher argmax
    feature_loss_sum: torch.Tensor | None = None                 # eagle: smooth-L1 to f_{t+1}


def default_token_feed(kind: str) -> str:
    """The kind's own choice: eagle/eagle3 feed their drafted tokens; mtp layers see data tokens."""
    return head_class(kind).default_token_feed


def step_counts(loss_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Valid positions per step, known before the forward (for global loss normalisation)."""
    seq = loss_mask.shape[1]
    return [loss_mask[:, k + 2:].float().sum() if seq > k + 2 else loss_mask.new_zeros((), dtype=torch.float32)
            for k in range(steps)]


def step0_feature(head: DraftHead, batch: dict) -> torch.Tensor:
    """The feature step 0 reads: the kind's dump feature through its projection (fc over the fused
    layers for eagle3; the target's last hidden as it is for eagle and mtp)."""
    return head.project(batch[head.feature])


def teacher_for(batch: dict, teacher: Teacher) -> TeacherDist:
    """The teacher over the draft vocab: from dumped top-k if present, else through the frozen lm_head."""
    if "topk_values" in batch and "topk_ids" in batch:
        return teacher.distribution_from_topk(batch["topk_values"], batch["topk_ids"])
    return teacher.distribution(batch["last_hidden"])


def unroll(head: DraftHead, batch: dict, teacher: Teacher, steps: int, mix: dict[str, float],
           token_feed: str = "draft", feature_loss: bool = False, teacher_dist: TeacherDist | None = None,
           teacher_top: torch.Tensor | None = None, checkpoint_steps: bool = False) -> UnrollResult:
    """Run `steps` draft steps over a batch and return per-step loss sums, counts and hits.

    `teacher_top` overrides the reference argmax for accuracy (held-out eval passes the
    target's full-vocabulary argmax mapped to draft ids, -1 when outside the draft vocab).
    `checkpoint_steps`: recompute each step in the backward (only where autograd records).
    """
    if token_feed not in TOKEN_FEEDS:
        raise ValueError(f"token_feed must be one of {TOKEN_FEEDS}, got {token_feed!r}")
    ids = batch["input_ids"]
    bsz, seq = ids.shape
    loss_mask = batch["loss_mask"].float()
    if "attention_mask" in batch:
        loss_mask = loss_mask * batch["attention_mask"].float()
    if teacher_dist is None:
        teacher_dist = teacher_for(batch, teacher)
    if teacher_top is None:
        teacher_top = teacher_dist.top
    labels = teacher.to_draft_ids(ids)
    if head.drafts_block:
        return _block_scores(head, batch, steps, teacher_dist, teacher_top, labels, loss_mask, mix)
    positions = torch.arange(seq, device=ids.device).unsqueeze(0).expand(bsz, -1)
    pad = ids.new_zeros(bsz, 1)
    tokens = torch.cat([ids[:, 1:], pad], dim=1)  # x_{t+1} at slot t
    feature = first_feature = step0_feature(head, batch)
    cache = TTTCache() if head.shares_layer else None
    out = UnrollResult()
    for k in range(steps):
        step = partial(_step_and_score, head, k, teacher_dist, teacher_top, labels, loss_mask, mix)
        hidden, drafted, scores = cached_step(step, cache, tokens, feature, positions + k, recompute=checkpoint_steps)
        for totals, value in zip((out.loss_sums, out.counts, out.correct), scores):
            totals.append(value)
        if feature_loss and k == 0:
            out.feature_loss_sum = _feature_loss_sum(hidden, batch["last_hidden"], loss_mask)
        if k + 1 == steps:
            break
        feature = hidden if head.chains_hidden() else first_feature
        if token_feed == "draft":
            tokens = head.draft_to_target(drafted)
        else:
            tokens = torch.cat([ids[:, k + 2:], ids.new_zeros(bsz, min(k + 2, seq))], dim=1)[:, :seq]
        tokens, feature = head.mask_inputs(tokens, feature) or (tokens, feature)
    return out


def _block_scores(head: DraftHead, batch: dict, steps: int, teacher: TeacherDist, teacher_top, labels, loss_mask,
                  mix) -> UnrollResult:
    """A block-drafting head (DFlash): one forward gives every step's logits (step k = mask slot k+1 of
    the block anchored after slot t), scored exactly as the unroll scores its steps."""
    out = UnrollResult()
    for k, logits in enumerate(head.training_logits(batch["input_ids"], batch[head.feature], steps)):
        for totals, value in zip((out.loss_sums, out.counts, out.correct),
                                 _score_step(k, logits, logits.detach().argmax(-1), teacher, teacher_top, labels,
                                             loss_mask, mix)):
            totals.append(value)
    return out


class TrainingUnroll(nn.Module):
    """The module the trainer hands to accelerate: `forward` runs the unroll over the wrapped head.

    Going through a module's forward() is what lets DDP, FSDP and DeepSpeed hook the backward and
    accelerate apply autocast. Its state_dict keys are the head's with a `head.` prefix
    (`head_state` strips it). Returns a dict of per-step lists (see `UnrollResult`).
    """

    def __init__(self, head: DraftHead, checkpoint_steps: bool = False) -> None:
        super().__init__()
        self.head = head
        self.checkpoint_steps = checkpoint_steps  # train.checkpoint_unroll

    def forward(self, batch: dict, teacher: Teacher, steps: int, mix: dict, token_feed: str = "draft",
                feature_loss: bool = False, teacher_top: torch.Tensor | None = None) -> dict:
        result = unroll(self.head, batch, teacher, steps, mix, token_feed=token_feed, feature_loss=feature_loss,
                        teacher_top=teacher_top, checkpoint_steps=self.checkpoint_steps)
        return {"loss_sums": result.loss_sums, "counts": result.counts, "correct": result.correct,
                "feature_loss_sum": result.feature_loss_sum}


def head_state(unroll_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """A `TrainingUnroll` state_dict with the head's own names (None stays None: under ZeRO-3 only
    the main process receives the gathered weights)."""
    if unroll_state is None:
        return None
    return {name.removeprefix("head."): tensor for name, tensor in unroll_state.items()}


def cached_step(step: Callable, cache: TTTCache | None, *inputs: torch.Tensor, recompute: bool = False) -> Any:
    """`step(step_cache, *inputs)`, its new keys/values then appended to `cache`; recomputed in the
    backward (non-reentrant checkpoint) when `recompute` and autograd records.

    The step runs on a private cache holding the blocks as they are now: a recomputation in the
    backward, when `cache` holds every later step's blocks too, must attend to these alone.
    """
    blocks = None if cache is None else {layer_idx: tuple(kv) for layer_idx, kv in cache.blocks.items()}
    run = partial(_on_cache_copy, step, blocks)
    if recompute and torch.is_grad_enabled():
        outputs, new_blocks = checkpoint(run, *inputs, use_reentrant=False)
    else:
        outputs, new_blocks = run(*inputs)
    for layer_idx, (key, value) in new_blocks.items():
        cache.append(layer_idx, key, value)
    return outputs


def _on_cache_copy(step: Callable, blocks: dict[int, tuple] | None, *inputs: torch.Tensor) -> tuple[Any, dict]:
    """step's outputs and {layer: (key, value)} it added, run on a fresh cache holding `blocks`."""
    if blocks is None:
        return step(None, *inputs), {}
    cache = TTTCache()
    cache.blocks = {layer_idx: list(kv) for layer_idx, kv in blocks.items()}
    outputs = step(cache, *inputs)
    return outputs, {layer_idx: kv[-1] for layer_idx, kv in cache.blocks.items() if len(kv) > len(blocks.get(layer_idx, ()))}


def _step_and_score(head: DraftHead, k: int, teacher: TeacherDist, teacher_top, labels, loss_mask, mix,
                    cache: TTTCache | None, tokens, feature, positions):
    """Step k and its scores, from its inputs alone: (hidden, drafted ids, (loss sum, count, hits))."""
    hidden, logits = head.step(k, tokens, feature, positions, past_key_values=cache)
    drafted = logits.detach().argmax(-1)  # [B, T] draft ids: accuracy, and the next step's tokens
    return hidden, drafted, _score_step(k, logits, drafted, teacher, teacher_top, labels, loss_mask, mix)


def _score_step(k: int, logits, drafted, teacher: TeacherDist, teacher_top, labels, loss_mask,
                mix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss sum, count and hits of step k over slots 0..T-k-3 (views, no gather: masked slots weigh 0)."""
    seq = logits.shape[1]
    length = seq - k - 2  # slots whose predicted token x_{t+k+2} exists
    if length <= 0:
        zero = logits.new_zeros((), dtype=torch.float32)
        return logits.sum() * 0.0, zero, zero  # the zero loss keeps every parameter in the graph (DDP)
    weight = loss_mask[:, k + 2:]
    span = slice(k + 1, seq - 1)  # teacher positions t+k+1 for slots t = 0..length-1
    losses = step_losses(logits[:, :length], teacher.probs[:, span], teacher.plogp[:, span],
                         labels[:, k + 2:], mix)
    hits = (drafted[:, :length] == teacher_top[:, span]).float()
    return (losses * weight).sum(), weight.sum(), (hits * weight).sum()


def _feature_loss_sum(hidden: torch.Tensor, last_hidden: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's regression: slot t's output hidden against the target's f_{t+1} (smooth L1, mean over H)."""
    seq = hidden.shape[1]
    if seq < 3:
        return hidden.sum() * 0.0
    weight = loss_mask[:, 2:]
    per_pos = F.smooth_l1_loss(hidden[:, :seq - 2].float(), last_hidden[:, 1:seq - 1].float(), reduction="none").mean(-1)
    return (per_pos * weight).sum()


def simulated_acceptance_length(step_accuracy: list[float]) -> float:
    """sum over k of the product of per-step accuracies up to k (expected accepted drafts, chain, greedy)."""
    total, running = 0.0, 1.0
    for acc in step_accuracy:
        running *= acc
        total += running
    return total
