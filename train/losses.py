"""Distillation losses and the teacher distribution.

The teacher is the target's own next-token distribution, recomputed at train time from
the stored `last_hidden` (the input of the target's lm_head) through the frozen lm_head,
in chunks of `train.teacher_chunk` positions and only over the draft vocabulary when one
is used (its softmax renormalised over those rows, as SpecForge does). The full-vocab fp32
teacher of a whole batch is never materialised. When the dump kept the teacher's top-k
instead (`dump.teacher: topk`), the teacher is the softmax over those k entries.

Per-position losses over the draft vocabulary, p = teacher, q = draft:
  forward_kl  sum p (log p - log q)                       (the default; KL(p || q))
  ce          -log q[label], label = the data's next token (0 where it is not in the draft vocab)
  tv          1/2 sum |p - q|
  jsd         1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q) / 2
  lk          -log sum min(p, q): minus the log of the one-step acceptance rate of speculative
              sampling (sum min(p, q) = 1 - tv), the direct acceptance objective published as an
              "LK loss"; forward KL pulls q towards p everywhere, this only where q is below p
  topk        -sum over the teacher's K most likely tokens of p log q (HASS's top-K distillation): the
              teacher's head, where a tree of width K drafts from, weighed again; K = the tree width
              (`train.tree_width`)
  confidence  BCE between a head's confidence c (the probability it gives that its draft is accepted;
              DSpark's confidence head) and 1 - tv of its logits against the teacher, detached: the
              acceptance rate of that step; only for a head with a confidence (`KindRules.losses`)
A mix (`train.loss: forward_kl:0.9,ce:0.1`) is the weighted sum. The trainer computes
forward KL as soft cross-entropy (logsumexp(z) - p.z, one fused autograd function) plus the
teacher's sum p log p, precomputed once per batch with its probabilities and argmax
(`TeacherDist`); `position_losses` is the plain reference the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.errors import EyasError
from eyas.recipe_checks import parse_loss_mix


def _xlogy_ratio(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum over vocab of p (log p - log q), with 0 log 0 = 0 (sparse top-k teachers have log p = -inf).

    Only exact -inf entries are zeroed: a NaN teacher must make the loss NaN, never 0.
    """
    return torch.where(torch.isneginf(logp), torch.zeros_like(p), p * (logp - logq)).sum(-1)


def forward_kl(teacher_logp: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    return _xlogy_ratio(teacher_logp.exp(), teacher_logp, draft_logq)


def hard_ce(draft_logq: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log q[label]; positions whose label is outside the draft vocabulary (label < 0) give 0."""
    safe = labels.clamp(min=0).unsqueeze(-1)
    nll = -draft_logq.gather(-1, safe).squeeze(-1)
    return torch.where(labels >= 0, nll, torch.zeros_like(nll))


def total_variation(teacher_logp: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    return 0.5 * (teacher_logp.exp() - draft_logq.exp()).abs().sum(-1)


def jensen_shannon(teacher_logp: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    p, q = teacher_logp.exp(), draft_logq.exp()
    log_m = torch.log((0.5 * (p + q)).clamp_min(torch.finfo(p.dtype).tiny))
    return 0.5 * _xlogy_ratio(p, teacher_logp, log_m) + 0.5 * _xlogy_ratio(q, draft_logq, log_m)


def negative_log_acceptance(teacher_logp: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    """-log sum_v min(p_v, q_v); the acceptance is floored at the dtype's tiny so a disjoint pair is finite."""
    accept = torch.minimum(teacher_logp.exp(), draft_logq.exp()).sum(-1)
    return -torch.log(accept.clamp_min(torch.finfo(accept.dtype).tiny))


def top_k_distillation(teacher_probs: torch.Tensor, draft_logq: torch.Tensor, k: int) -> torch.Tensor:
    """-sum over the teacher's k most likely tokens of p log q (the rest of the vocabulary does not count)."""
    p, ids = teacher_probs.topk(min(k, teacher_probs.shape[-1]), dim=-1)
    return -(p * draft_logq.gather(-1, ids)).sum(-1)


LOSSES = {"forward_kl": forward_kl, "tv": total_variation, "jsd": jensen_shannon, "lk": negative_log_acceptance}


def _term(name: str, teacher_probs: torch.Tensor, teacher_logp: torch.Tensor, draft_logq: torch.Tensor,
          labels: torch.Tensor, topk: int) -> torch.Tensor:
    """One loss term per position (every term but forward KL's fused path and the confidence's)."""
    if name == "ce":
        return hard_ce(draft_logq, labels)
    if name == "topk":
        return top_k_distillation(teacher_probs, draft_logq, topk)
    return LOSSES[name](teacher_logp, draft_logq)


def position_losses(draft_logits: torch.Tensor, teacher_logp: torch.Tensor, labels: torch.Tensor,
                    mix: dict[str, float] | str, topk: int = 1) -> torch.Tensor:
    """The weighted loss mix per position: [N, V] logits and teacher log-probs -> [N] (fp32); `topk`: the
    `topk` term's K."""
    if isinstance(mix, str):
        mix = parse_loss_mix(mix)
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    total = torch.zeros(logq.shape[:-1], dtype=torch.float32, device=logq.device)
    for name, weight in mix.items():
        if weight == 0:
            continue
        total = total + weight * _term(name, teacher_logp.exp(), teacher_logp, logq, labels, topk)
    return total


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p_v log softmax(z)_v = logsumexp(z) - p.z, with the gradient softmax(z) - p.

    One fused function instead of log_softmax + multiply + sum and their autograd graph: the
    [positions, vocab] tensors are walked a few times instead of a few dozen (on a CPU the
    elementwise passes, not the lm_head matmul, dominated the step).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, probs, lse)
        return lse - torch.linalg.vecdot(probs, z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, probs, lse = ctx.saved_tensors
        g = torch.exp(logits.float() - lse.unsqueeze(-1))
        g.sub_(probs).mul_(grad.unsqueeze(-1))
        return g.to(logits.dtype), None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-position -sum p log q over the last dim (q = softmax(logits)); fp32 result."""
    return _SoftCrossEntropy.apply(logits, probs)


@dataclass
class TeacherDist:
    """The teacher of a batch over the draft vocabulary: probabilities [B,T,V] (fp32), sum p log p
    [B,T] (so forward KL = soft cross-entropy + plogp), and its argmax [B,T] (draft ids)."""

    probs: torch.Tensor
    plogp: torch.Tensor
    top: torch.Tensor


def confidence_loss(confidence: torch.Tensor, teacher_logp: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    """BCE of the confidence logits [...] towards the step's acceptance rate 1 - tv (detached: the confidence
    learns to predict it, it does not pull the draft)."""
    accept = (1.0 - total_variation(teacher_logp, draft_logq.detach())).clamp(0.0, 1.0)
    return F.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")


def step_losses(logits: torch.Tensor, probs: torch.Tensor, plogp: torch.Tensor, labels: torch.Tensor,
                mix: dict[str, float], confidence: torch.Tensor | None = None, topk: int = 1) -> torch.Tensor:
    """The loss mix per position for [..., V] draft logits against a teacher slice; [...] fp32.

    forward_kl goes through the fused soft cross-entropy; the others use the definitions above. `confidence`:
    the head's confidence logits [...], which a `confidence` term needs; `topk`: the `topk` term's K.
    """
    total = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    generic = {name: w for name, w in mix.items() if w and name not in ("forward_kl", "confidence")}
    if mix.get("confidence") and confidence is None:
        raise EyasError("recipe key 'train.loss' has a 'confidence' term, but this draft gives no confidence; "
                        "remove the term (only a head with a confidence head trains one)")
    if mix.get("forward_kl"):
        total = total + mix["forward_kl"] * (soft_cross_entropy(logits, probs) + plogp)
    if confidence is not None and not mix.get("confidence"):
        total = total + 0.0 * confidence.float()  # an untrained confidence head stays in the graph (DDP)
    if generic or mix.get("confidence"):
        logq = F.log_softmax(logits.float(), dim=-1)
        logp = torch.log(probs)
        for name, weight in generic.items():
            total = total + weight * _term(name, probs, logp, logq, labels, topk)
        if mix.get("confidence"):
            total = total + mix["confidence"] * confidence_loss(confidence, logp, logq)
    return total


class Teacher:
    """The frozen target lm_head, restricted to the draft vocabulary, applied in chunks.

    `lm_head_weight` is the target's [V, H] output matrix; `d2t` (draft id -> offset to the
    target id) selects its rows. Holds two row blocks: the draft rows (the teacher proper)
    and the remaining rows, used only to find the target's full-vocabulary argmax for an
    honest held-out acceptance (a draft can never propose a token outside its vocabulary).
    """

    def __init__(self, lm_head_weight: torch.Tensor, d2t: torch.Tensor | None, chunk: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        vocab = lm_head_weight.shape[0]
        weight = lm_head_weight.detach().to(device=device, dtype=dtype)
        self.chunk = int(chunk)
        self.vocab_size = vocab
        if d2t is None:
            self.weight = weight.contiguous()
            self.rest_weight = None
            self.target_to_draft = None
        else:
            rows = (torch.arange(len(d2t)) + d2t.cpu()).to(device)
            in_draft = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_draft[rows] = True
            self.weight = weight[rows].contiguous()
            self.rest_weight = weight[~in_draft].contiguous()
            # target id -> draft id (-1 outside the draft vocabulary), for hard-CE labels
            self.target_to_draft = torch.full((vocab,), -1, dtype=torch.long, device=device)
            self.target_to_draft[rows] = torch.arange(len(rows), device=device)

    @property
    def draft_vocab_size(self) -> int:
        return self.weight.shape[0]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft ids, -1 where the token is outside the draft vocabulary."""
        if self.target_to_draft is None:
            return target_ids
        return self.target_to_draft[target_ids]

    @torch.no_grad()
    def logprobs(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> teacher log-probs over the draft vocabulary [B, T, V_draft] (fp32), chunked."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        out = torch.empty(flat.shape[0], self.weight.shape[0], dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], self.chunk):
            part = flat[start:start + self.chunk].to(self.weight.dtype)
            out[start:start + self.chunk] = F.log_softmax((part @ self.weight.T).float(), dim=-1)
        return out.view(*last_hidden.shape[:-1], -1)

    @torch.no_grad()
    def distribution(self, last_hidden: torch.Tensor) -> TeacherDist:
        """Probabilities, sum p log p and argmax over the draft vocabulary, computed in chunks."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        n, vocab = flat.shape[0], self.weight.shape[0]
        probs = torch.empty(n, vocab, dtype=torch.float32, device=flat.device)
        plogp = torch.empty(n, dtype=torch.float32, device=flat.device)
        top = torch.empty(n, dtype=torch.long, device=flat.device)
        for start in range(0, n, self.chunk):
            part = flat[start:start + self.chunk].to(self.weight.dtype)
            logp = F.log_softmax((part @ self.weight.T).float(), dim=-1)
            p = torch.exp(logp, out=probs[start:start + self.chunk])
            plogp[start:start + self.chunk] = torch.linalg.vecdot(p, logp)
            top[start:start + self.chunk] = logp.argmax(-1)
        shape = last_hidden.shape[:-1]
        return TeacherDist(probs.view(*shape, vocab), plogp.view(shape), top.view(shape))

    @torch.no_grad()
    def distribution_from_topk(self, topk_values: torch.Tensor, topk_ids: torch.Tensor) -> TeacherDist:
        logp = self.logprobs_from_topk(topk_values, topk_ids)
        probs = logp.exp()
        plogp = torch.where(torch.isneginf(logp), torch.zeros_like(probs), probs * logp).sum(-1)
        return TeacherDist(probs, plogp, logp.argmax(-1))

    @torch.no_grad()
    def full_argmax_in_draft(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Draft id of the target's full-vocabulary argmax at each position, -1 if outside the draft vocab."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for start in range(0, flat.shape[0], self.chunk):
            part = flat[start:start + self.chunk].to(self.weight.dtype)
            best_val, best_idx = (part @ self.weight.T).float().max(-1)
            if self.rest_weight is not None and self.rest_weight.shape[0] > 0:
                rest_val = (part @ self.rest_weight.T).float().max(-1).values
                best_idx = torch.where(rest_val > best_val, torch.full_like(best_idx, -1), best_idx)
            out[start:start + self.chunk] = best_idx
        return out.view(last_hidden.shape[:-1])

    @torch.no_grad()
    def logprobs_from_topk(self, topk_values: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """A sparse teacher from the dumped top-k: softmax over the k values, placed at their draft ids.

        Works for logits and log-probs alike (the softmax over the k entries renormalises
        either); entries outside the draft vocabulary are dropped before renormalising.
        """
        draft_ids = self.to_draft_ids(topk_ids.long())
        values = topk_values.float().masked_fill(draft_ids < 0, float("-inf"))
        logp_k = torch.log_softmax(values, dim=-1)
        out = torch.full((*topk_ids.shape[:-1], self.draft_vocab_size), float("-inf"), device=topk_values.device)
        src = torch.where(draft_ids >= 0, logp_k, torch.full_like(logp_k, float("-inf")))
        # amax: a dropped entry (sent to id 0 with -inf) never overwrites a kept one
        return out.scatter_reduce_(-1, draft_ids.clamp(min=0), src, reduce="amax", include_self=True)
