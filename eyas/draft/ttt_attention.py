"""Training-time-test attention in memory linear in the sequence.

The mask (see `TTTCache`): the query of step k at slot t attends to block-0 keys (the context)
at slots s <= t and to block-j keys (1 <= j <= k) at slot t only (the diagonal); one softmax
over all of them. Written densely that is a [B, H, T, T] score tensor per step (the reference
below): 19 GB at the 8B recipe's shapes and 4 x 2048 tokens, and 8K-token sequences do not fit
in 80 GB.

`ttt_attention` splits the softmax into its two parts and merges them exactly, as ring attention
merges the blocks of a sequence:
- context: a fused causal kernel (flash attention: the CPU one, or CUDA's in bf16/fp16) that
  also returns its log-sum-exp lse_ctx [B, H, T] (natural log of the scaled scores);
- diagonal: one score per earlier step, s_j = scale * <q_t, k_j,t>, [B, H, T] each;
- lse = logsumexp(lse_ctx, s_1..s_k) and out = exp(lse_ctx - lse) o_ctx + sum_j exp(s_j - lse) v_j,
  in fp32.
The backward calls the kernel's own backward with the MERGED out and lse: the kernel recomputes
P = exp(S - lse) (the merged attention's probabilities of the context keys) and
D = rowsum(dout * out) (the merged attention's), which is all dS = P (dP - D) needs, so the
context gradients are exact without a gradient through lse; the diagonal terms are done by hand.
Nothing T x T is stored, or formed outside the kernel's tiles.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Blocks = list[tuple[torch.Tensor, torch.Tensor]]

CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CUDA_FLASH_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FlashKernel:
    """A causal flash-attention kernel pair: forward -> (out, lse [B,H,T] fp32, aux), backward -> (dq, dk, dv).

    `aux` is what the kernel's backward needs besides the tensors (CUDA: sequence bounds and the
    unused dropout seed); kv may have fewer heads than q (GQA), as both kernels take them.
    """

    name: str
    forward: Callable
    backward: Callable


def _cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, aux, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        dout, q, k, v, out, lse, 0.0, True, scale=scale)


def _cuda_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention.default(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_backward(dout, q, k, v, out, lse, aux, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    if dout.stride(-1) != 1:  # the kernel reads rows of head_dim contiguously
        dout = dout.contiguous()
    return torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


CPU_FLASH = FlashKernel("cpu_flash", _cpu_forward, _cpu_backward)
CUDA_FLASH = FlashKernel("cuda_flash", _cuda_forward, _cuda_backward)


def flash_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[FlashKernel | None, str]:
    """The fused kernel for these inputs, or None and why not (the caller falls back to the dense path)."""

    def cuda_flash_runs() -> bool:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
        return torch.backends.cuda.can_use_flash_attention(params, False)

    return kernel_for(q.device.type, q.dtype, cuda_flash_runs)


def kernel_for(device_type: str, dtype: torch.dtype, cuda_flash_runs: Callable[[], bool]) -> tuple[FlashKernel | None, str]:
    """The decision of `flash_kernel`, apart from the tensors: `cuda_flash_runs()` is torch's own
    check of the shapes on the GPU (head_dim, architecture, build), asked only where the rest allows."""
    if device_type == "cpu":
        if dtype in CPU_FLASH_DTYPES:
            return CPU_FLASH, ""
        return None, f"the CPU flash kernel does not take {dtype}"
    if device_type == "cuda":
        if dtype not in CUDA_FLASH_DTYPES:
            return None, (f"CUDA's flash kernel takes bf16/fp16, not {dtype}: train in bf16 "
                          "(train.mixed_precision=bf16), or the dense attention stores [B, H, T, T] scores per step")
        if not cuda_flash_runs():
            return None, "flash attention does not run these shapes on this GPU (head_dim, architecture or build)"
        return CUDA_FLASH, ""
    return None, f"no fused attention kernel on {device_type}"


def dense_fallback_reason(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """Why training-time-test attention would run densely on `device` for a draft's attention shape ("" if it
    runs fused): asked once at the start of training with a few tokens of that shape, so that a run the dense
    path cannot hold is refused then (train/memory.py, `refuse_if_too_big`) instead of hours later."""
    q = torch.zeros(1, heads, 8, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, kv_heads, 8, head_dim, device=device, dtype=dtype)
    return flash_kernel(q, kv, kv)[1]


_warned: set[str] = set()


def _warn_dense_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"training-time-test attention falls back to the dense path (memory quadratic in the "
                      f"sequence): {reason}", RuntimeWarning, stacklevel=3)


def _no_autocast(device_type: str):
    """The merge runs in the dtypes it chose (fp32 statistics), whatever autocast is active outside."""
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (as sdpa under autocast), else q's.

    Under autocast q/k come out of RoPE in fp32 (cos/sin are fp32) while v is the projection's bf16;
    sdpa (step 0, and the dense path's matmuls) run them in autocast's dtype, so this path does too.
    """
    device = q.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return q.dtype


class FusedTTTAttention(torch.autograd.Function):
    """out = attention of q over [context (causal), diagonal blocks]; inputs q, k0, v0, k1, v1, ..., kk, vk.

    Saves q, the keys and values, out, the merged lse and the diagonal probabilities: all O(T).
    """

    @staticmethod
    def forward(ctx, kernel: FlashKernel, scale: float, q, k0, v0, *diag):
        keys, values = diag[0::2], diag[1::2]
        groups = q.shape[1] // k0.shape[1]
        with _no_autocast(q.device.type):
            out_ctx, lse_ctx, aux = kernel.forward(q, k0, v0, scale)
            qf = q.float().unflatten(1, (-1, groups))  # [B, KV, G, T, D]: a kv head serves G query heads
            scores = [lse_ctx.unflatten(1, (-1, groups))]
            scores += [(qf * kj.float().unsqueeze(2)).sum(-1) * scale for kj in keys]
            stacked = torch.stack(scores, dim=-1)  # [B, KV, G, T, 1 + k]: the context's lse, then one score per step
            lse = torch.logsumexp(stacked, dim=-1)
            probs = torch.exp(stacked - lse.unsqueeze(-1))
            merged = probs[..., :1] * out_ctx.float().unflatten(1, (-1, groups))
            for j, vj in enumerate(values, start=1):
                merged += probs[..., j:j + 1] * vj.float().unsqueeze(2)
            # the kernel's own layouts, which its backward reads the merged values in
            out = torch.empty_like(out_ctx).copy_(merged.flatten(1, 2))
            lse_out = torch.empty_like(lse_ctx).copy_(lse.flatten(1, 2))
        ctx.kernel, ctx.scale, ctx.aux, ctx.groups = kernel, scale, aux, groups
        ctx.save_for_backward(q, k0, v0, *diag, out, lse_out, probs[..., 1:].contiguous())
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, *rest = ctx.saved_tensors
        *diag, out, lse, probs = rest
        keys, values = diag[0::2], diag[1::2]
        scale, groups = ctx.scale, ctx.groups
        with _no_autocast(q.device.type):
            dq, dk0, dv0 = ctx.kernel.backward(dout, q, k0, v0, out, lse, ctx.aux, scale)
            grad = dout.float().unflatten(1, (-1, groups))
            delta = (grad * out.float().unflatten(1, (-1, groups))).sum(-1)  # D = rowsum(dout * out), [B, KV, G, T]
            qf = q.float().unflatten(1, (-1, groups))
            dqf = dq.float().unflatten(1, (-1, groups))
            diag_grads = []
            for j, (kj, vj) in enumerate(zip(keys, values)):
                p = probs[..., j]  # [B, KV, G, T]
                dv = (p.unsqueeze(-1) * grad).sum(2)  # summed over the G query heads of each kv head
                ds = p * ((grad * vj.float().unsqueeze(2)).sum(-1) - delta)
                dqf = dqf + scale * ds.unsqueeze(-1) * kj.float().unsqueeze(2)
                dk = scale * (ds.unsqueeze(-1) * qf).sum(2)
                diag_grads += [dk.to(kj.dtype), dv.to(vj.dtype)]
        return None, None, dqf.flatten(1, 2).to(q.dtype), dk0, dv0, *diag_grads


def ttt_attention(q: torch.Tensor, blocks: Blocks, scale: float) -> torch.Tensor:
    """The TTT mask's attention of q [B, H, T, D] over `blocks` [(k, v) of [B, KV, T, D]], block 0 the context.

    Step 0 (one block) is plain causal sdpa; later steps go through `FusedTTTAttention` where a
    fused kernel runs the inputs, else through the dense reference (with a one-time warning). The
    kernel runs in `compute_dtype`; the output comes back in q's dtype, as the dense path's does.
    """
    k0, v0 = blocks[0]
    if len(blocks) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale, enable_gqa=True)
    dtype = compute_dtype(q)
    cast = [t.to(dtype) for t in (q, k0, v0)]
    kernel, reason = flash_kernel(*cast)
    if kernel is None:
        _warn_dense_once(reason)
        return ttt_attention_reference(q, blocks, scale)
    diag = [t.to(dtype) for kv in blocks[1:] for t in kv]
    return FusedTTTAttention.apply(kernel, scale, *cast, *diag).to(q.dtype)  # q's dtype, as the dense path returns


def ttt_attention_reference(q: torch.Tensor, blocks: Blocks, scale: float) -> torch.Tensor:
    """The same attention written densely (the code before the fused path): causal sdpa for one block,
    else [B, KV, G, T, T] context scores, a causal mask and one fp32 softmax over [context, diagonal].
    Memory quadratic in T; the tests' and the fallback's path."""
    bsz, heads, seq, dim = q.shape
    k0, v0 = blocks[0]
    if len(blocks) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale, enable_gqa=True)
    groups = heads // k0.shape[1]
    qg = q.view(bsz, -1, groups, seq, dim)
    ctx = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)) * scale  # [B, KV, G, T, T]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    ctx = ctx.masked_fill(causal, float("-inf"))
    diag = torch.stack([(qg * kj.unsqueeze(2)).sum(-1) for kj, _ in blocks[1:]], dim=-1) * scale
    probs = torch.softmax(torch.cat([ctx, diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs[..., :seq], v0.unsqueeze(2))
    for j, (_, vj) in enumerate(blocks[1:]):
        out = out + probs[..., seq + j: seq + j + 1] * vj.unsqueeze(2)
    return out.reshape(bsz, heads, seq, dim)
