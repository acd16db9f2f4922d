"""Losses and the chunked teacher: definitions, chunking, draft-vocab restriction, top-k, pinned values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from train_helpers import draft_cfg, synthetic_batch, tiny_d2t, tiny_target_config

from eyas.draft.registry import build_head
from eyas.errors import EyasError
from eyas.recipe_checks import parse_loss_mix
from eyas.train.losses import (
    Teacher,
    confidence_loss,
    forward_kl,
    hard_ce,
    jensen_shannon,
    negative_log_acceptance,
    position_losses,
    soft_cross_entropy,
    step_losses,
    total_variation,
)
from eyas.train.ttt import unroll


def _pair(seed=0, n=6, v=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2


def test_losses_match_their_definitions():
    t_logits, d_logits = _pair()
    logp, logq = t_logits.log_softmax(-1), d_logits.log_softmax(-1)
    p, q = logp.exp(), logq.exp()
    torch.testing.assert_close(forward_kl(logp, logq), (p * (p.log() - q.log())).sum(-1))
    torch.testing.assert_close(forward_kl(logp, logq), F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1))
    torch.testing.assert_close(total_variation(logp, logq), 0.5 * (p - q).abs().sum(-1))
    m = 0.5 * (p + q)
    jsd = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(jensen_shannon(logp, logq), jsd)
    torch.testing.assert_close(jensen_shannon(logp, logq), jensen_shannon(logq, logp))  # symmetric
    assert (jensen_shannon(logp, logq) <= math.log(2) + 1e-6).all()
    labels = torch.tensor([0, 3, -1, 10, 5, -1])
    ce = hard_ce(logq, labels)
    ref = F.cross_entropy(d_logits, labels.clamp(min=0), reduction="none")
    torch.testing.assert_close(ce, torch.where(labels >= 0, ref, torch.zeros_like(ref)))
    assert torch.allclose(forward_kl(logp, logp), torch.zeros(6), atol=1e-6)


def test_lk_is_minus_log_acceptance_and_pushes_q_up_only_where_it_is_below_p():
    t_logits, d_logits = _pair(3)
    logp = t_logits.log_softmax(-1)
    z = d_logits.clone().requires_grad_()
    logq = z.log_softmax(-1)
    p, q = logp.exp(), logq.exp()
    accept = torch.minimum(p, q).sum(-1)
    lk = negative_log_acceptance(logp, logq)
    torch.testing.assert_close(lk, -accept.log())
    torch.testing.assert_close(accept, 1 - total_variation(logp, logq))  # sum min(p, q) = 1 - TV
    assert torch.allclose(negative_log_acceptance(logp, logp), torch.zeros(6), atol=1e-6)
    # d(-log alpha)/dq_v = -1/alpha where q_v < p_v and 0 where q_v > p_v: a gradient step
    # raises the tokens the draft under-proposes and leaves the over-proposed ones to the softmax
    grad_logq = torch.autograd.grad(lk.sum(), logq)[0]  # = dL/dq * q
    under = q < p
    torch.testing.assert_close(grad_logq[under], (-q / accept.unsqueeze(-1))[under])
    assert (grad_logq[~under] == 0).all()
    disjoint = torch.full((1, 4), float("-inf"))
    disjoint[0, 0] = 0.0
    other = torch.full((1, 4), float("-inf"))
    other[0, 1] = 0.0
    assert torch.isfinite(negative_log_acceptance(disjoint, other)).all()  # floored, not inf


def test_mix_is_the_weighted_sum():
    t_logits, d_logits = _pair(1)
    logp = t_logits.log_softmax(-1)
    labels = torch.arange(6)
    mix = position_losses(d_logits, logp, labels, "forward_kl:0.9,ce:0.1,tv:0.5,jsd:2,lk:0.3")
    logq = d_logits.log_softmax(-1)
    ref = 0.9 * forward_kl(logp, logq) + 0.1 * hard_ce(logq, labels) + 0.5 * total_variation(logp, logq) \
        + 2 * jensen_shannon(logp, logq) + 0.3 * negative_log_acceptance(logp, logq)
    torch.testing.assert_close(mix, ref)
    assert parse_loss_mix("forward_kl:0.9,ce:0.1") == {"forward_kl": 0.9, "ce": 0.1}


def test_fused_soft_cross_entropy_matches_autograd_reference():
    t_logits, d_logits = _pair(2, n=7, v=13)
    logp = t_logits.log_softmax(-1)
    z1 = d_logits.clone().requires_grad_()
    z2 = d_logits.clone().requires_grad_()
    fused = soft_cross_entropy(z1, logp.exp()) + (logp.exp() * logp).sum(-1)
    reference = forward_kl(logp, z2.log_softmax(-1))
    torch.testing.assert_close(fused, reference)
    g = torch.randn(7)
    (fused * g).sum().backward()
    (reference * g).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad)
    labels = torch.arange(7)
    mix = {"forward_kl": 0.7, "ce": 0.2, "tv": 0.1, "jsd": 0.5, "lk": 0.4}
    p = logp.exp()
    torch.testing.assert_close(step_losses(d_logits, p, (p * logp).sum(-1), labels, mix),
                               position_losses(d_logits, logp, labels, mix))
    nan_teacher = p.clone()
    nan_teacher[3, 0] = float("nan")
    assert torch.isnan(soft_cross_entropy(d_logits, nan_teacher)[3])  # a NaN teacher is never hidden


def test_teacher_chunks_and_restricts_to_draft_vocab():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 64, generator=g)
    hidden = torch.randn(2, 13, 64, generator=g)
    d2t = tiny_d2t()
    rows = torch.arange(200) + d2t
    full = hidden @ weight.T
    expected = full[..., rows].log_softmax(-1)  # renormalised over the draft vocabulary
    for chunk in (1, 5, 26, 4096):
        torch.testing.assert_close(Teacher(weight, d2t, chunk).logprobs(hidden), expected)
    argmax = Teacher(weight, d2t, 7).full_argmax_in_draft(hidden)
    target_arg = full.argmax(-1)
    to_draft = torch.full((384,), -1)
    to_draft[rows] = torch.arange(200)
    assert torch.equal(argmax, to_draft[target_arg])
    assert (argmax == -1).any() and (argmax >= 0).any()
    dist = Teacher(weight, d2t, 5).distribution(hidden)
    torch.testing.assert_close(dist.probs, expected.exp())
    torch.testing.assert_close(dist.plogp, (expected.exp() * expected).sum(-1))
    assert torch.equal(dist.top, expected.argmax(-1))
    no_vocab = Teacher(weight, None, 3)
    torch.testing.assert_close(no_vocab.logprobs(hidden), full.log_softmax(-1))
    assert torch.equal(no_vocab.full_argmax_in_draft(hidden), target_arg)


def test_teacher_never_builds_a_full_vocab_batch_tensor(monkeypatch):
    """Each matmul covers at most `chunk` positions and only the draft rows."""
    weight = torch.randn(384, 64)
    teacher = Teacher(weight, tiny_d2t(), chunk=4)
    shapes = []
    real_log_softmax = F.log_softmax

    def spy(x, dim=-1, **kw):
        shapes.append(tuple(x.shape))
        return real_log_softmax(x, dim=dim, **kw)

    monkeypatch.setattr(F, "log_softmax", spy)
    teacher.logprobs(torch.randn(3, 10, 64))
    teacher.distribution(torch.randn(3, 10, 64))
    assert len(shapes) == 16 and all(s[0] <= 4 and s[1] == 200 for s in shapes)


def test_topk_teacher_renormalises_over_kept_entries():
    d2t = tiny_d2t()  # draft vocab = even ids and 1, 3, ..., 15
    teacher = Teacher(torch.randn(384, 64), d2t, 8)
    values = torch.tensor([[[3.0, 2.0, 1.0, 0.5]]])
    ids = torch.tensor([[[4, 17, 0, 10]]])  # 17 is outside the draft vocab
    logp = teacher.logprobs_from_topk(values, ids)
    kept = torch.tensor([3.0, 1.0, 0.5]).log_softmax(-1)
    draft_ids = teacher.to_draft_ids(torch.tensor([4, 0, 10]))
    assert torch.equal(teacher.to_draft_ids(torch.tensor([17])), torch.tensor([-1]))
    assert torch.allclose(logp[0, 0, draft_ids], kept)
    assert torch.isinf(logp).sum() == 200 - 3
    assert torch.allclose(logp.exp().sum(-1), torch.ones(1, 1))


# Pinned per-step losses of a seeded tiny eagle3 head on a seeded synthetic batch (computed once).
PINNED = {
    "forward_kl": [4.975091457366943, 4.970027446746826, 5.055561065673828],
    "ce": [2.552198886871338, 2.5830554962158203, 2.7579402923583984],
    "tv": [0.9888602495193481, 0.9890938401222229, 0.9894850850105286],
    "jsd": [0.6671313047409058, 0.6674196720123291, 0.6686360239982605],
    "lk": [4.670246124267578, 4.683587551116943, 4.751718997955322],  # >= -log(1 - tv) per step (Jensen)
}


@pytest.mark.parametrize("loss", sorted(PINNED))
def test_pinned_step_losses(loss):
    torch.manual_seed(1234)
    tc = tiny_target_config()
    head = build_head(draft_cfg("eagle3"), tc, d2t=tiny_d2t())
    teacher = Teacher(torch.randn(384, 64) * 3, tiny_d2t(), chunk=8)
    batch = synthetic_batch(seed=5)
    result = unroll(head, batch, teacher, 3, parse_loss_mix(loss))
    got = [float(s.detach() / c) for s, c in zip(result.loss_sums, result.counts)]
    assert got == pytest.approx(PINNED[loss], rel=1e-4)


def test_confidence_loss_learns_the_acceptance_rate_without_pulling_the_draft():
    """`confidence`: BCE of the confidence logits towards 1 - tv of the step's draft against the teacher; the draft's
    logits get no gradient from it, and a mix naming it needs a head that gives a confidence."""
    torch.manual_seed(0)
    logits, t_logits = torch.randn(5, 11, requires_grad=True), torch.randn(5, 11)
    confidence = torch.randn(5, requires_grad=True)
    logp, logq = t_logits.log_softmax(-1), logits.log_softmax(-1)
    accept = 1 - total_variation(logp, logq.detach())
    want = -(accept * torch.nn.functional.logsigmoid(confidence) + (1 - accept) * torch.nn.functional.logsigmoid(-confidence))
    got = confidence_loss(confidence, logp, logq)
    torch.testing.assert_close(got, want)
    p = logp.exp()
    mixed = step_losses(logits, p, (p * logp).sum(-1), torch.arange(5), {"tv": 0.5, "confidence": 2.0}, confidence)
    torch.testing.assert_close(mixed, 0.5 * total_variation(logp, logq) + 2.0 * want)
    got.sum().backward()
    assert logits.grad is None and confidence.grad.abs().sum() > 0
    with pytest.raises(EyasError, match="has a 'confidence' term, but this draft gives no confidence"):
        step_losses(logits, p, (p * logp).sum(-1), torch.arange(5), {"confidence": 1.0})
