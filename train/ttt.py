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

Each drafting layout (`eyas.draft.layouts`) has its scoring in `SCORING`: the shared layer (above), the
parallel slots (the shared layer's unroll with every step k > 0 reading the head's mask slot), a layer per
step (mtp, above). A head that drafts a whole block in one forward (the block layout: dflash, dspark) is not
unrolled: its `training_rows` give every step at once (step k at slot t is the k-th predicting row of the block
anchored at x_{t+1}, so it predicts x_{t+k+2} too), and `_block` scores them as the steps are scored.

Training for a tree (`TreeLevers`, docs/stages.md): with `follow`, step k+1 at slot t reads the target's token
where it ranked below the tree's width W among step k's drafts (the branch a tree verify continues), else the
draft's argmax; with `align` (GRIFFIN's mask), step k at slot t is scored only while every earlier step of slot t
ranked the target's token below W. The `topk` loss term's K is W too.

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
from torch import nn
from torch.utils.checkpoint import checkpoint

from eyas.draft.blocks import TTTCache
from eyas.draft.head import DraftHead
from eyas.draft.layouts import BLOCK, LAYER_PER_STEP, PARALLEL_SLOTS, SHARED_LAYER, Layout
from eyas.train.losses import Teacher, TeacherDist, step_losses

TOKEN_FEEDS = ("draft", "data")


@dataclass
class UnrollResult:
    """Per-step sums over valid positions; the caller normalises (global counts under DDP)."""

    loss_sums: list[torch.Tensor] = field(default_factory=list)  # weighted by loss_mask, with grad
    counts: list[torch.Tensor] = field(default_factory=list)     # sum of loss_mask over valid positions
    correct: list[torch.Tensor] = field(default_factory=list)    # draft argmax == teacher argmax
    # per step, when counted (held-out eval): loss-masked positions by the reference token's rank in the draft's
    # logits, [ranks + 1], the last bucket every rank >= ranks (and a reference outside the draft vocabulary); with
    # the align lever, only the positions its mask still scores (the branch reached the step): the sum is the reach
    rank_counts: list[torch.Tensor] = field(default_factory=list)
    # per step, when counted (held-out eval): the teacher's probability on the draft's top-W tokens, summed over the
    # loss-masked positions (W: `TreeLevers.width`)
    cover_sums: list[torch.Tensor] = field(default_factory=list)
    feature_loss_sum: torch.Tensor | None = None                 # eagle: smooth-L1 to f_{t+1}
    first_hidden: torch.Tensor | None = None                     # step 0's output hidden, while the unroll runs

    def add(self, scores: tuple[torch.Tensor, ...]) -> None:
        """Append one step's (loss sum, count, hits, counts by rank or None, top-W cover or None)."""
        for totals, value in zip((self.loss_sums, self.counts, self.correct, self.rank_counts, self.cover_sums), scores):
            if value is not None:
                totals.append(value)


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


@dataclass(frozen=True)
class TreeLevers:
    """How an unroll trains for a tree of width `width` (the module docstring, "Training for a tree")."""

    width: int = 1
    follow: bool = False  # step k+1 reads the target's token where it ranked < width at step k (train.sibling_feed)
    align: bool = False  # score step k only where every earlier step ranked the target's token < width (train.align_mask)

    @property
    def ranks_reference(self) -> bool:
        return self.follow or self.align


@dataclass(frozen=True)
class _Targets:
    """What every step is scored against: the teacher, the accuracy reference, the labels and the loss mask."""

    teacher: TeacherDist
    top: torch.Tensor  # [B, T] the reference argmax (draft ids, -1 outside the draft vocabulary)
    labels: torch.Tensor  # [B, T] the data's tokens as draft ids
    loss_mask: torch.Tensor  # [B, T] float
    mix: dict[str, float]
    ranks: int = 0  # count positions by the reference's rank below this (0: not counted; see UnrollResult)
    levers: TreeLevers = TreeLevers()


def unroll(head: DraftHead, batch: dict, teacher: Teacher, steps: int, mix: dict[str, float],
           token_feed: str = "draft", feature_loss: bool = False, teacher_dist: TeacherDist | None = None,
           teacher_top: torch.Tensor | None = None, checkpoint_steps: bool = False, ranks: int = 0,
           levers: TreeLevers = TreeLevers()) -> UnrollResult:
    """Run `steps` draft steps over a batch, as the head's layout drafts them, and return per-step loss sums,
    counts and hits (and with `ranks` > 0, positions by the reference token's rank and the teacher's probability on
    the draft's top `levers.width`: `UnrollResult.rank_counts`, `cover_sums`; the rank counts only where the align
    lever still scores, so a tree's rates at depth k are over the positions its branch reached). `levers`: training
    for a tree.

    `feature_loss`: also score the kind's loss on step 0's hidden (`DraftHead.feature_loss_sum`, EAGLE-1's
    feature regression) where it has one. `teacher_top` overrides the reference argmax for accuracy (held-out
    eval passes the target's full-vocabulary argmax mapped to draft ids, -1 when outside the draft vocab).
    `checkpoint_steps`: recompute each step in the backward (only where autograd records).
    """
    if token_feed not in TOKEN_FEEDS:
        raise ValueError(f"token_feed must be one of {TOKEN_FEEDS}, got {token_feed!r}")
    loss_mask = batch["loss_mask"].float()
    if "attention_mask" in batch:
        loss_mask = loss_mask * batch["attention_mask"].float()
    if teacher_dist is None:
        teacher_dist = teacher_for(batch, teacher)
    targets = _Targets(teacher_dist, teacher_dist.top if teacher_top is None else teacher_top,
                       teacher.to_draft_ids(batch["input_ids"]), loss_mask, mix, ranks, levers)
    out = SCORING[head.layout](head, batch, steps, targets, token_feed, checkpoint_steps)
    if feature_loss:
        out.feature_loss_sum = head.feature_loss_sum(out.first_hidden, batch.get("last_hidden"), loss_mask)
    out.first_hidden = None
    return out


def _unroll_steps(head: DraftHead, batch: dict, steps: int, targets: _Targets, token_feed: str,
                  checkpoint_steps: bool, cache: TTTCache | None, next_inputs: Callable) -> UnrollResult:
    """The unroll of a layout that drafts step by step: step k+1 reads `next_inputs(head, tokens, hidden,
    first_feature)` (tokens: the drafted or data tokens, per `token_feed`), on `cache` (None: each step its own
    layer, attending only to its own step's keys)."""
    ids = batch["input_ids"]
    bsz, seq = ids.shape
    positions = torch.arange(seq, device=ids.device).unsqueeze(0).expand(bsz, -1)
    tokens = _shifted(ids, 1)  # x_{t+1} at slot t
    feature = first_feature = step0_feature(head, batch)
    reached = torch.ones(bsz, seq, device=ids.device) if targets.levers.align else None
    out = UnrollResult()
    for k in range(steps):
        step = partial(_step_and_score, head, k, targets)
        hidden, drafted, within, scores = cached_step(step, cache, tokens, feature, positions + k, reached,
                                                      recompute=checkpoint_steps)
        out.add(scores)
        if k == 0:
            out.first_hidden = hidden
        if k + 1 == steps:
            break
        reached = _still_reached(reached, within)
        if token_feed == "draft":
            tokens = head.draft_to_target(_followed(drafted, within, targets, k) if targets.levers.follow else drafted)
        else:
            tokens = _shifted(ids, k + 2)
        tokens, feature = next_inputs(head, tokens, hidden, first_feature)
    return out


def _shared_layer(head, batch, steps, targets, token_feed, checkpoint_steps) -> UnrollResult:
    """One layer for every step: step k sees the context (step 0's keys) and its own slot's earlier steps."""
    return _unroll_steps(head, batch, steps, targets, token_feed, checkpoint_steps, TTTCache(),
                         lambda head, tokens, hidden, first: (tokens, hidden))


def _parallel_slots(head, batch, steps, targets, token_feed, checkpoint_steps) -> UnrollResult:
    """The shared layer's unroll, every step k > 0 reading the head's mask slot instead of what was drafted."""
    return _unroll_steps(head, batch, steps, targets, token_feed, checkpoint_steps, TTTCache(),
                         lambda head, tokens, hidden, first: head.mask_slots(tokens, hidden))


def _layer_per_step(head, batch, steps, targets, token_feed, checkpoint_steps) -> UnrollResult:
    """Layer k for step k, attending causally to its own step's keys; its feature per `DraftHead.next_feature`."""
    return _unroll_steps(head, batch, steps, targets, token_feed, checkpoint_steps, None,
                         lambda head, tokens, hidden, first: (tokens, head.next_feature(hidden, first)))


def _block(head, batch, steps, targets, token_feed, checkpoint_steps) -> UnrollResult:
    """A block-drafting head (DFlash, DSpark): one forward gives every step's row, scored exactly as the unroll
    scores its steps (`block_steps`)."""
    out = UnrollResult()
    ids = batch["input_ids"]
    reached = torch.ones(ids.shape, device=ids.device) if targets.levers.align else None
    for k, (logits, confidence) in enumerate(block_steps(head, ids, batch[head.feature], steps)):
        scores, within = _score_step(k, logits, logits.detach().argmax(-1), targets, confidence, reached)
        out.add(scores)
        reached = _still_reached(reached, within)
    return out


def block_steps(head: DraftHead, input_ids: torch.Tensor, features: torch.Tensor, steps: int
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per unroll step k of a block-drafting head: (logits [B, T, V], confidence logits [B, T] or None), slot t
    predicting x_{t+k+2} from the block anchored at x_{t+1}. A row reads the data's token at its own position,
    x_{t+k+1} (teacher forcing: at inference, what the step before drafted), where the kind reads one (DSpark's
    Markov and confidence heads); the confidence where the head declares one (`gives_confidence`)."""
    rows = head.training_rows(input_ids, features, steps)
    out = []
    for k in range(steps):
        prev = _shifted(input_ids, k + 1)
        confidence = head.slot_confidence(rows[:, :, k], prev) if head.gives_confidence else None
        out.append((head.slot_logits(rows[:, :, k], prev), confidence))
    return out


def _shifted(ids: torch.Tensor, n: int) -> torch.Tensor:
    """x_{t+n} at slot t, zeros past the end."""
    bsz, seq = ids.shape
    return torch.cat([ids[:, n:], ids.new_zeros(bsz, min(n, seq))], dim=1)[:, :seq]


# The training-time scoring of each drafting layout (eyas.draft.layouts).
SCORING: dict[Layout, Callable[..., UnrollResult]] = {
    SHARED_LAYER: _shared_layer, PARALLEL_SLOTS: _parallel_slots, LAYER_PER_STEP: _layer_per_step, BLOCK: _block}


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
                feature_loss: bool = False, teacher_top: torch.Tensor | None = None, ranks: int = 0,
                levers: TreeLevers = TreeLevers()) -> dict:
        result = unroll(self.head, batch, teacher, steps, mix, token_feed=token_feed, feature_loss=feature_loss,
                        teacher_top=teacher_top, checkpoint_steps=self.checkpoint_steps, ranks=ranks, levers=levers)
        return {"loss_sums": result.loss_sums, "counts": result.counts, "correct": result.correct,
                "rank_counts": result.rank_counts, "cover_sums": result.cover_sums,
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


def _step_and_score(head: DraftHead, k: int, targets: _Targets, cache: TTTCache | None, tokens, feature, positions,
                    reached):
    """Step k and its scores, from its inputs alone: (hidden, drafted ids, where the target's token ranked below the
    tree's width or None, scores)."""
    hidden, logits = head.step(k, tokens, feature, positions, past_key_values=cache)
    drafted = logits.detach().argmax(-1)  # [B, T] draft ids: accuracy, and the next step's tokens
    scores, within = _score_step(k, logits, drafted, targets, reached=reached)
    return hidden, drafted, within, scores


def _score_step(k: int, logits, drafted, targets: _Targets, confidence: torch.Tensor | None = None,
                reached: torch.Tensor | None = None) -> tuple[tuple, torch.Tensor | None]:
    """((loss sum, count, hits, positions by rank or None, top-W cover or None), within) of step k over slots
    0..T-k-3 (views, no gather: masked slots weigh 0). `within` [B, T-k-2]: the target's token ranked below the
    tree's width, where a lever needs it (else None). `confidence`: the head's confidence logits [B, T] for the
    step, which the mix's `confidence` term trains; `reached` [B, T]: the align mask's weight per slot (None: off)."""
    seq = logits.shape[1]
    length = seq - k - 2  # slots whose predicted token x_{t+k+2} exists
    ranks = targets.ranks
    if length <= 0:
        zero = logits.new_zeros((), dtype=torch.float32)
        counted = (logits.new_zeros(ranks + 1, dtype=torch.float32), zero) if ranks else (None, None)
        # the zero loss keeps every parameter in the graph (DDP)
        return (logits.sum() * 0.0, zero, zero, *counted), None
    weight = targets.loss_mask[:, k + 2:]
    span = slice(k + 1, seq - 1)  # teacher positions t+k+1 for slots t = 0..length-1
    levers, probs = targets.levers, targets.teacher.probs[:, span]
    losses = step_losses(logits[:, :length], probs, targets.teacher.plogp[:, span], targets.labels[:, k + 2:],
                         targets.mix, None if confidence is None else confidence[:, :length], topk=levers.width)
    scored = weight if reached is None else weight * reached[:, :length]
    hits = (drafted[:, :length] == targets.top[:, span]).float()
    rank = _reference_rank(logits[:, :length].detach(), targets.top[:, span]) if ranks or levers.ranks_reference else None
    counted = (_by_rank(rank, scored, ranks), _cover(logits[:, :length].detach(), probs, weight, levers.width)) \
        if ranks else (None, None)
    within = rank < levers.width if levers.ranks_reference else None
    return ((losses * scored).sum(), weight.sum(), (hits * weight).sum(), *counted), within


def _followed(drafted: torch.Tensor, within: torch.Tensor, targets: _Targets, k: int) -> torch.Tensor:
    """The draft ids step k+1 reads on a tree's branch: the target's token where step k ranked it below the width,
    else the draft's argmax (slots past step k's scored ones keep the argmax)."""
    length = within.shape[1]
    reference = targets.top[:, k + 1:k + 1 + length]
    return torch.cat([torch.where(within, reference, drafted[:, :length]), drafted[:, length:]], dim=1)


def _still_reached(reached: torch.Tensor | None, within: torch.Tensor | None) -> torch.Tensor | None:
    """The align mask after a step: a slot stays reached while the step ranked the target's token below the width."""
    if reached is None:
        return None
    length = within.shape[1]
    return torch.cat([reached[:, :length] * within.float(), reached[:, length:]], dim=1)


def _reference_rank(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The reference token's rank among the draft's logits: the draft tokens scored above it, a tie counted above
    where its id is lower (as `argmax` breaks ties, so rank 0 is exactly `argmax == reference`: in bf16, ties are
    common and a tie counted for the reference made the rank-0 rate exceed the accuracy); the vocabulary's size for
    a reference outside the draft vocabulary (-1)."""
    index = reference.clamp(min=0).unsqueeze(-1)
    scored = logits.gather(-1, index)
    lower_id = torch.arange(logits.shape[-1], device=logits.device) < index
    rank = ((logits > scored) | ((logits == scored) & lower_id)).sum(-1)
    return torch.where(reference < 0, logits.shape[-1], rank)


def _by_rank(rank: torch.Tensor, weight: torch.Tensor, ranks: int) -> torch.Tensor:
    """[ranks + 1] weighted positions by the reference token's rank, every rank >= `ranks` (a reference outside the
    draft vocabulary included) in the last bucket."""
    return weight.new_zeros(ranks + 1, dtype=torch.float32).index_add_(
        0, rank.clamp(max=ranks).flatten(), weight.flatten().float())


def _cover(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
    """The teacher's probability on the draft's `width` best tokens, summed over the weighted positions."""
    top = logits.topk(min(width, logits.shape[-1]), dim=-1).indices
    return (probs.gather(-1, top).sum(-1) * weight).sum()
