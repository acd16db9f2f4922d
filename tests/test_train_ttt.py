"""Training-time test: step k consumes step k-1's output (hidden and token), the mask leaks
nothing from the future or from other slots' drafts, gradients flow as designed."""

from __future__ import annotations

import pytest
import torch
from train_helpers import draft_cfg, synthetic_batch, tiny_d2t, tiny_target_config

from eyas.draft.registry import build_head
from eyas.shapes import simulated_acceptance_length
from eyas.train.losses import Teacher
from eyas.train.ttt import step_counts, unroll

MIX = {"forward_kl": 1.0}


def _setup(kind="eagle3", **kw):
    torch.manual_seed(0)
    d2t = tiny_d2t() if kind == "eagle3" else None
    head = build_head(draft_cfg(kind, **kw), tiny_target_config(), d2t=d2t)
    teacher = Teacher(torch.randn(384, 64) * 3, d2t, chunk=16)
    return head, teacher, synthetic_batch(seed=3)


def _losses(head, teacher, batch, steps=4, **kw):
    result = unroll(head, batch, teacher, steps, MIX, **kw)
    return [float(s.detach() / c) for s, c in zip(result.loss_sums, result.counts)], result


def _perturb_call(module, call_index, fn):
    """Forward hook that rewrites `module`'s output on its call number `call_index` (0-based)."""
    calls = {"n": 0}

    def hook(_mod, _inp, out):
        n = calls["n"]
        calls["n"] += 1
        return fn(out) if n == call_index else out

    return module.register_forward_hook(hook)


def test_step_k_consumes_step_k_minus_1_hidden():
    head, teacher, batch = _setup()
    base, _ = _losses(head, teacher, batch)
    handle = _perturb_call(head.midlayer, 1, lambda h: h + 0.5 * torch.randn_like(h))  # step 1's output hidden
    try:
        perturbed, _ = _losses(head, teacher, batch)
    finally:
        handle.remove()
    assert perturbed[0] == base[0]          # step 0 runs before the perturbation
    assert perturbed[2] != pytest.approx(base[2], rel=1e-6)  # step 2 reads step 1's hidden
    assert perturbed[3] != pytest.approx(base[3], rel=1e-6)


def test_step_k_consumes_step_k_minus_1_token():
    """Change only step 1's logits (hence its argmax token), not its hidden: step 2 changes."""
    head, teacher, batch = _setup()
    base, _ = _losses(head, teacher, batch)

    def flip(logits):
        return logits.roll(1, dims=-1)  # every argmax moves to the next draft id

    handle = _perturb_call(head.lm_head, 1, flip)
    try:
        perturbed, _ = _losses(head, teacher, batch)
    finally:
        handle.remove()
    assert perturbed[0] == base[0]
    assert perturbed[2] != pytest.approx(base[2], rel=1e-6)
    handle = _perturb_call(head.lm_head, 1, flip)
    try:  # with data tokens, step 2 no longer reads step 1's token: only step 1's own loss moves
        data_base, _ = _losses(head, teacher, batch, token_feed="data")
    finally:
        handle.remove()
    data_clean, _ = _losses(head, teacher, batch, token_feed="data")
    assert data_base[2] == data_clean[2] and data_base[1] != data_clean[1]


def test_gradient_of_step_k_reaches_step_k_minus_1_hidden_not_its_token():
    head, teacher, batch = _setup()
    saved = {}

    def keep(_mod, _inp, out):
        if "h1" not in saved and saved.setdefault("calls", 0) == 1:
            out.retain_grad()
            saved["h1"] = out
        saved["calls"] += 1

    handle = head.midlayer.register_forward_hook(keep)
    try:
        result = unroll(head, batch, teacher, 3, MIX)
    finally:
        handle.remove()
    result.loss_sums[2].backward()
    assert saved["h1"].grad is not None and saved["h1"].grad.abs().sum() > 0
    # The embedding is frozen and the fed token is an argmax: no gradient path through it.
    assert head.embed_tokens.weight.grad is None


def test_no_leak_from_future_positions_or_other_slots():
    """Outputs at slot t, every step, are unchanged when tokens/features after t+1 change."""
    head, teacher, batch = _setup()
    t = 6
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][:, t + 2:] = (changed["input_ids"][:, t + 2:] + 7) % 384
    changed["aux_hidden"][:, t + 1:] += 1.0
    outs = []
    for b in (batch, changed):
        logits = []
        handle = head.lm_head.register_forward_hook(lambda m, i, o, out=logits: out.append(o.detach()))
        try:
            unroll(head, b, teacher, 4, MIX, token_feed="draft")
        finally:
            handle.remove()
        outs.append(logits)
    for k in range(4):
        torch.testing.assert_close(outs[0][k][:, :t + 1], outs[1][k][:, :t + 1], rtol=0, atol=0)
        assert not torch.equal(outs[0][k][:, t + 2:], outs[1][k][:, t + 2:])


def test_mtp_target_feed_ignores_previous_hidden_and_chain_reads_it():
    head, teacher, batch = _setup("mtp", num_steps=3, mtp_feed="target")
    base, _ = _losses(head, teacher, batch, steps=3, token_feed="data")
    handle = _perturb_call(head.layers[0], 0, lambda h: h + torch.randn_like(h))
    try:
        perturbed, _ = _losses(head, teacher, batch, steps=3, token_feed="data")
    finally:
        handle.remove()
    assert perturbed[1] == base[1] and perturbed[0] != base[0]
    head.config.mtp_feed = "chain"
    base, _ = _losses(head, teacher, batch, steps=3, token_feed="data")
    handle = _perturb_call(head.layers[0], 0, lambda h: h + torch.randn_like(h))
    try:
        perturbed, _ = _losses(head, teacher, batch, steps=3, token_feed="data")
    finally:
        handle.remove()
    assert perturbed[1] != pytest.approx(base[1], rel=1e-6)


def test_counts_and_valid_positions():
    head, teacher, batch = _setup()
    _, result = _losses(head, teacher, batch, steps=5)
    expected = step_counts(batch["loss_mask"], 5)
    assert [float(c) for c in result.counts] == [float(c) for c in expected]
    # row 0: loss on 3..15, row 1 (3 pads): 3..12; step k counts labels at positions >= k+2
    assert [float(c) for c in expected] == [23.0, 23.0, 21.0, 19.0, 17.0]


def test_eagle_feature_loss_targets_next_feature():
    head, teacher, batch = _setup("eagle")
    result = unroll(head, batch, teacher, 1, MIX, feature_loss=True)
    assert result.feature_loss_sum is not None and float(result.feature_loss_sum) > 0
    result.feature_loss_sum.backward()
    assert head.fc.weight.grad.abs().sum() > 0 and head.lm_head.weight.grad is None


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 3.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert simulated_acceptance_length([0.8, 0.0, 1.0]) == pytest.approx(0.8)
