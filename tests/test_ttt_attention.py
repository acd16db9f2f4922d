"""Training-time-test attention in linear memory: the fused path (a flash kernel for the context merged
with the diagonal through log-sum-exps) equals the dense reference in value and gradient, stores O(T)
for the backward where the reference stores O(T^2), runs the CUDA kernel's calls with the right
arguments (checked on meta tensors), and the unroll's activation checkpointing changes no bit."""

from __future__ import annotations

import warnings

import pytest
import torch
from train_helpers import draft_cfg, synthetic_batch, tiny_d2t, tiny_target_config

import eyas.draft.ttt_attention as tta
from eyas.draft.registry import build_head
from eyas.draft.ttt_attention import (
    CPU_FLASH,
    CUDA_FLASH,
    FusedTTTAttention,
    dense_fallback_reason,
    flash_kernel,
    kernel_for,
    ttt_attention,
    ttt_attention_reference,
)
from eyas.train.losses import Teacher
from eyas.train.ttt import unroll

BATCH, SEQ, DIM = 2, 37, 16  # an odd length: no tile of the kernel lines up with it


def _inputs(blocks: int, heads: int, kv_heads: int, dtype=torch.float32, seq: int = SEQ, seed: int = 0):
    """q in the layout DraftAttention hands over ([B, T, H, D] memory viewed as [B, H, T, D]), kv blocks, dout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq, heads, DIM, generator=g, dtype=torch.float64).transpose(1, 2)
    kv = [(torch.randn(BATCH, kv_heads, seq, DIM, generator=g, dtype=torch.float64),
           torch.randn(BATCH, kv_heads, seq, DIM, generator=g, dtype=torch.float64)) for _ in range(blocks)]
    dout = torch.randn(BATCH, heads, seq, DIM, generator=g, dtype=torch.float64)
    return q.to(dtype), [(k.to(dtype), v.to(dtype)) for k, v in kv], dout.to(dtype)


def _value_and_grads(fn, q, kv, dout):
    """fn's output and the gradients of <out, dout> w.r.t. q and every k, v (fresh leaves)."""
    q = q.detach().clone().requires_grad_()
    kv = [(k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()) for k, v in kv]
    out = fn(q, kv, DIM ** -0.5)
    leaves = [q, *(t for pair in kv for t in pair)]
    return [out, *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5])
def test_fused_equals_reference_fp32(blocks, heads, kv_heads):
    """Steps k = 0..4: output and the gradients of q, k0, v0 and every k_j, v_j, to fp32 rounding."""
    q, kv, dout = _inputs(blocks, heads, kv_heads)
    fused = _value_and_grads(ttt_attention, q, kv, dout)
    reference = _value_and_grads(ttt_attention_reference, q, kv, dout)
    assert len(fused) == 2 + 2 * blocks
    for got, want in zip(fused, reference):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("blocks", [2, 3, 5])
def test_fused_bf16_within_bf16_rounding_of_the_exact_values(blocks, heads, kv_heads):
    """bf16 inputs: every output and gradient within 2% of its tensor's largest magnitude of the fp64 values
    (bf16 keeps 8 bits: 0.4% per rounding, a few roundings deep), as the dense path in bf16 is."""
    q, kv, dout = _inputs(blocks, heads, kv_heads, dtype=torch.float64)
    exact = _value_and_grads(ttt_attention_reference, q, kv, dout)
    low = (q.bfloat16(), [(k.bfloat16(), v.bfloat16()) for k, v in kv], dout.bfloat16())
    fused = _value_and_grads(ttt_attention, *low)
    dense = _value_and_grads(ttt_attention_reference, *low)
    for got, other, want in zip(fused, dense, exact):
        assert got.dtype == torch.bfloat16
        scale = want.abs().max()
        assert (got.double() - want).abs().max() / scale < 0.02
        assert (other.double() - want).abs().max() / scale < 0.02


def test_cpu_kernel_lse_is_the_natural_log_sum_exp_of_scaled_causal_scores():
    """The merge relies on it: lse[b, h, t] = log sum_{s <= t} exp(scale q_t . k_s), also with GQA."""
    q, kv, _ = _inputs(1, 4, 2)
    (k, v), scale = kv[0], DIM ** -0.5
    out, lse, _ = CPU_FLASH.forward(q, k, v, scale)
    scores = torch.einsum("bkgtd,bksd->bkgts", q.unflatten(1, (2, 2)), k) * scale
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).flatten(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, (torch.softmax(scores, -1) @ v.unsqueeze(2)).flatten(1, 2), atol=1e-5, rtol=1e-5)


def _saved_bytes(fn, seq: int) -> int:
    """Bytes of the distinct storages autograd keeps for fn's backward (inputs included)."""
    q, kv, _ = _inputs(5, 4, 2, seq=seq)
    q.requires_grad_()
    for k, v in kv:
        k.requires_grad_()
        v.requires_grad_()
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, kv, DIM ** -0.5)
    return sum(saved.values())


def test_saved_memory_is_linear_in_the_sequence_for_the_fused_path_only():
    """Doubling T doubles what the fused path stores for the backward; the dense one's grows ~4x."""
    fused = _saved_bytes(ttt_attention, 512), _saved_bytes(ttt_attention, 1024)
    dense = _saved_bytes(ttt_attention_reference, 512), _saved_bytes(ttt_attention_reference, 1024)
    assert fused[1] / fused[0] == pytest.approx(2.0, rel=0.02)
    assert dense[1] / dense[0] > 3.5
    assert dense[1] > 4 * fused[1]


def test_outputs_are_the_same_bits_run_to_run():
    q, kv, dout = _inputs(4, 4, 2)
    first = _value_and_grads(ttt_attention, q, kv, dout)
    second = _value_and_grads(ttt_attention, q, kv, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_under_cpu_autocast_the_fused_path_runs_in_bf16_like_the_dense_one():
    """Under autocast q/k come out of RoPE in fp32 and v in bf16: the fused path computes in autocast's
    dtype (its values within bf16 rounding of the dense path's) and returns q's dtype as the dense path does."""
    q, kv, dout = _inputs(3, 4, 2)
    kv = [(k, v.bfloat16()) for k, v in kv]
    with torch.autocast("cpu", torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the fused kernel takes the inputs
        fused = ttt_attention(q, kv, DIM ** -0.5)
        dense = ttt_attention_reference(q, kv, DIM ** -0.5)
    assert fused.dtype == dense.dtype == torch.float32
    torch.testing.assert_close(fused.float(), dense.float(), atol=0.05, rtol=0.05)


def test_cuda_kernel_calls_match_the_aten_schemas_on_meta_tensors():
    """Argument order and shapes of the CUDA flash forward/backward calls, through their meta functions:
    the whole fused function (GQA, 3 blocks) forward and backward, outputs and grads shaped like the inputs."""
    q = torch.empty(BATCH, SEQ, 4, 128, device="meta", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    kv = [torch.empty(BATCH, 2, SEQ, 128, device="meta", dtype=torch.bfloat16).requires_grad_() for _ in range(6)]
    out = FusedTTTAttention.apply(CUDA_FLASH, 128 ** -0.5, q, *kv)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, [q, *kv], torch.empty_like(out))
    assert [g.shape for g in grads] == [t.shape for t in [q, *kv]]
    _, lse, aux = CUDA_FLASH.forward(q.detach(), kv[0].detach(), kv[1].detach(), 128 ** -0.5)
    assert lse.shape == (BATCH, 4, SEQ) and lse.dtype == torch.float32 and len(aux) == 6


def test_kernel_choice_and_the_one_time_fallback_warning(monkeypatch):
    q, kv, _ = _inputs(1, 4, 2)
    assert flash_kernel(q, *kv[0])[0] is CPU_FLASH
    assert flash_kernel(q.to("meta"), kv[0][0].to("meta"), kv[0][1].to("meta"))[0] is None
    monkeypatch.setattr(tta, "_warned", set())
    q, kv, _ = _inputs(3, 4, 2)
    meta_kv = [(k.to("meta"), v.to("meta")) for k, v in kv]
    with pytest.warns(RuntimeWarning, match="dense path"):
        out = ttt_attention(q.to("meta"), meta_kv, DIM ** -0.5)
    assert out.shape == q.shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ttt_attention(q.to("meta"), meta_kv, DIM ** -0.5)  # the same reason warns once


def test_the_fallback_decision_for_an_8k_run_on_a_gpu():
    """What the trainer asks at the start on a GPU (Llama-3.1-8B's attention: 32 heads, 8 kv heads, head_dim 128):
    bf16 takes CUDA's flash kernel where torch says it runs the shapes; fp32 never does (torch is not asked);
    an architecture or head_dim flash cannot run falls back, with the reason the refusal quotes."""
    asked = []

    def runs(answer):
        return lambda: asked.append(answer) or answer

    assert kernel_for("cuda", torch.bfloat16, runs(True)) == (CUDA_FLASH, "")
    kernel, reason = kernel_for("cuda", torch.bfloat16, runs(False))
    assert kernel is None and "does not run these shapes on this GPU" in reason
    kernel, reason = kernel_for("cuda", torch.float32, runs(True))
    assert kernel is None and "train.mixed_precision=bf16" in reason and asked == [True, False]
    for dtype in (torch.bfloat16, torch.float32):  # the CPU's kernel takes both: no fallback here
        assert dense_fallback_reason(torch.device("cpu"), dtype, 32, 8, 128) == ""
    assert "no fused attention kernel on meta" in dense_fallback_reason(torch.device("meta"), torch.bfloat16, 32, 8, 128)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp"])
def test_checkpointed_unroll_gives_the_same_bits_and_stores_less(kind):
    """train.checkpoint_unroll: identical losses and gradients (the recomputation sees the same cache
    blocks), and less kept for the backward outside the recomputed steps."""
    results = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        d2t = tiny_d2t() if kind == "eagle3" else None
        head = build_head(draft_cfg(kind, **({"num_steps": 4} if kind == "mtp" else {})), tiny_target_config(), d2t=d2t)
        teacher = Teacher(torch.randn(384, 64) * 3, d2t, chunk=16)
        saved: dict[int, int] = {}

        def pack(tensor, saved=saved):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = unroll(head, synthetic_batch(seed=3), teacher, 4, {"forward_kl": 1.0}, checkpoint_steps=checkpoint)
        sum(w * s for w, s in zip([1.0, 0.8, 0.64, 0.512], out.loss_sums)).backward()
        grads = [p.grad for p in head.parameters() if p.requires_grad]
        assert all(g is not None for g in grads)
        results.append(([s.detach() for s in out.loss_sums], grads, sum(saved.values())))
    (plain_losses, plain_grads, plain_saved), (ckpt_losses, ckpt_grads, ckpt_saved) = results
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, ckpt_losses))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, ckpt_grads))
    assert ckpt_saved < plain_saved / 2
