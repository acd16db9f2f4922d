"""Long sequences: memory and time of the TTT unroll's attention (fused vs dense) and of checkpointing it.

Run: `python benchmarks/bench_long_context.py` (about 5-8 minutes on 2 loaded CPU cores; `--smoke` for
tiny shapes, `--heads 32 --kv-heads 8` for the 8B layer's full head count, by estimate about an hour here).

Three parts; A's two paths at one T, and B's pair, run side by side (interleaved rounds) in a fresh
subprocess each, so their peaks are their own and their times see the same load:

A. The draft layer's TTT attention at the 8B recipe's per-head shapes (head_dim 128, 4 query heads
   per kv head) through a 7-step unroll (TTTCache, `DraftAttention._ttt_attention`, RoPE at t + k),
   forward and backward, fp32, batch 1, T = 2048 / 4096 / 8192: the fused path (production) and the
   dense reference (`ttt_attention_reference`, the code before it). q/k/v enter each step as new
   tensors (what the projections produce); the projections themselves are left out: at 8192 tokens
   their 7-step fp32 forward and backward alone take over 10 minutes on this CPU and are the same for
   both paths. The default runs 4 query heads / 1 kv head (1/8 of the 8B's 32 / 8): every tensor and
   kernel call of the attention has a head dimension, so the 8B layer's memory and time are 8x these
   (reported as `scaled_to_heads`). A dense case whose estimate exceeds `--budget-gb` is not run; its
   figure is an estimate (the measured peak of the largest dense case that ran, scaled by the ratio of
   the traced peaks, see below) and says so.
B. Activation checkpointing where it pays: the real `train.ttt.unroll` of an eagle3 head (hidden 512,
   4/1 heads of 128, intermediate 1792, the 8B recipe's draft vocabulary 32000, teacher through a
   lm_head, forward-KL), T = 2048, fp32, with and without `checkpoint_steps` (`train.checkpoint_unroll`).
C. The 8B eagle3 draft on an 80 GB GPU, estimated: the same real unroll at the full shapes (hidden 4096,
   32/8 heads, intermediate 14336, draft vocab 32000, teacher chunked through lm_head) run on fake
   tensors (`FakeTensorMode`: shapes only, no memory, seconds) under bf16 autocast, with a dispatch
   mode that adds up the bytes of live tensors op by op: the traced peak of activations and gradients.
   The estimate: the traced peak times part B's measured / traced ratio (the allocator's overhead on
   the same unroll), plus fp32 weights, AdamW's two fp32 states and the teacher's bf16 lm_head, at
   T = 8192 / 16384 / 32768 (batch 1); and again with the largest measured / traced ratio of any case
   here. "fits" in 80 GB (78 GiB usable): yes (both fit), tight (only the first), no.

Peak memory of a subprocess case: freed heap memory is handed back (malloc_trim) and the kernel's
peak-RSS mark (VmHWM) reset through /proc/self/clear_refs after setup and between repeats; the
figure is VmHWM after the forward+backward minus VmRSS before it (median over repeats).
`saved_bytes`: the bytes of the distinct storages autograd saved for the backward
(`saved_tensors_hooks`, traced on fake tensors): the analytic activation memory.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
from machine import add_report_args, apply_smoke, bench_lines, child_json, environment, output_path, reset_peak, status_kib, write_json

RESULTS = Path(__file__).parent / "results" / "bench_long_context.json"
GIB = 2 ** 30
HIDDEN_8B, HEADS_8B, KV_8B, HEAD_DIM, INTERMEDIATE_8B, VOCAB_8B, DRAFT_VOCAB = 4096, 32, 8, 128, 14336, 128256, 32000
GPU_USABLE_GIB = 78.0  # an 80 GB card less the CUDA context and kernels' workspaces


# ---- the cases ---------------------------------------------------------------------------------------------


def head_config(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int):
    from eyas.draft.config import HeadConfig

    return HeadConfig(kind="eagle3", num_layers=1, num_steps=1, hidden_size=hidden, intermediate_size=intermediate,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      draft_vocab_size=vocab, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def attention_case(spec: dict):
    """Part A: a closure running the 7-step TTT attention unroll forward and backward."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from eyas.draft.blocks import DraftAttention, TTTCache, rotary_embedding
    from eyas.draft.ttt_attention import ttt_attention_reference

    cfg = head_config(HIDDEN_8B, spec["heads"], spec["kv_heads"], spec["head_dim"], INTERMEDIATE_8B, DRAFT_VOCAB)
    with torch.device("meta"):  # its projections are not run (see the module docstring)
        layer = DraftAttention(cfg, 2 * cfg.hidden_size)
    device = spec.get("device", "cpu")  # --device: cuda measures torch.cuda.max_memory_allocated instead of RSS
    dtype = getattr(torch, spec.get("dtype", "float32"))  # a GPU runs the fused path in bf16/fp16 only
    rotary = rotary_embedding(cfg).to(device)
    seq, heads, kv_heads, dim = spec["seq"], spec["heads"], spec["kv_heads"], spec["head_dim"]
    if spec["path"] == "fused":
        attend = layer._ttt_attention
    else:  # the code before the fused path: sdpa at step 0, dense scores after
        def attend(q, blocks):
            return ttt_attention_reference(q, blocks, layer.scaling)

    positions = torch.arange(seq, device=device).unsqueeze(0)
    generator = torch.Generator(device).manual_seed(0)

    def run() -> None:
        cache, loss = TTTCache(), 0.0
        for k in range(spec["steps"]):
            q, key, value = (torch.randn(1, n, seq, dim, generator=generator, device=device).to(dtype).requires_grad_()
                             for n in (heads, kv_heads, kv_heads))
            cos, sin = rotary(q, positions + k)
            q, key = apply_rotary_pos_emb(q, key, cos, sin)
            out = attend(q, cache.append(0, key, value))
            loss = loss + out.square().mean()
        loss.backward()

    return run


def eagle3_head(spec: dict):
    """An eagle3 head on a Llama-shaped target of the spec's sizes (draft vocabulary = the target's)."""
    from transformers import LlamaConfig

    from eyas.draft.registry import build_head
    from eyas.recipe_schema import DraftConfig

    target = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                         num_hidden_layers=32, num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                         head_dim=spec["head_dim"], max_position_embeddings=131072, rope_theta=500000.0)
    torch.manual_seed(0)
    return build_head(DraftConfig(kind="eagle3"), target)


def unroll_case(spec: dict, head=None):
    """Parts B and C: a closure running `train.ttt.unroll` of an eagle3 head and its backward."""
    from eyas.train.losses import Teacher
    from eyas.train.ttt import unroll

    head = eagle3_head(spec) if head is None else head
    hidden, seq, dtype = spec["hidden"], spec["seq"], getattr(torch, spec["dtype"])
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, spec["vocab"], (1, seq), generator=generator),
             "loss_mask": torch.ones(1, seq), "attention_mask": torch.ones(1, seq, dtype=torch.long),
             "aux_hidden": torch.randn(1, seq, 3 * hidden, generator=generator).to(dtype),
             "last_hidden": torch.randn(1, seq, hidden, generator=generator).to(dtype)}
    teacher = Teacher(torch.randn(spec["vocab"], hidden, generator=generator) * hidden ** -0.5, None, 2048, dtype)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16)
    weights = [0.8 ** k for k in range(spec["steps"])]

    def run() -> None:
        head.zero_grad(set_to_none=True)
        with autocast:
            out = unroll(head, batch, teacher, spec["steps"], {"forward_kl": 1.0}, checkpoint_steps=spec["checkpoint"])
            loss = sum(w * s for w, s in zip(weights, out.loss_sums))
        loss.backward()

    return run


def build_case(spec: dict):
    return attention_case(spec) if spec["part"] == "attention" else unroll_case(spec)


# ---- measuring in a subprocess -------------------------------------------------------------------------------


def _reset_peak() -> bool:
    """Hand freed heap memory back to the kernel (else a repeat reuses it unseen), then reset VmHWM to VmRSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: only the first repeat's figure is exact
        pass
    try:
        reset_peak()
        return True
    except OSError:
        return False


def measure_here(specs: list[dict]) -> list[dict]:
    """Run the cases interleaved, `repeats` rounds, in this process (side by side: the same load on each):
    per case the seconds and the peak memory above the pre-run level of every round."""
    for spec in specs:  # one-time library set-up (thread pools, kernels) outside the figures
        build_case({**spec, "seq": min(spec["seq"], 64)})()
    runs = [build_case(spec) for spec in specs]
    results = [{"seconds": [], "peak_bytes": [], "peak_mark_reset": True} for _ in specs]
    for _ in range(specs[0]["repeats"]):
        for spec, run, result in zip(specs, runs, results):
            cuda = spec.get("device", "cpu").startswith("cuda")
            gc.collect()
            if cuda:  # the allocator's peak above what was allocated before the run
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            else:
                result["peak_mark_reset"] = _reset_peak() and result["peak_mark_reset"]
                before = status_kib("VmRSS")
            started = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize()
            result["seconds"].append(time.perf_counter() - started)
            result["peak_bytes"].append(torch.cuda.max_memory_allocated() - before if cuda
                                        else (status_kib("VmHWM") - before) * 1024)
    return results


def measure(specs: list[dict], in_process: bool = False, timeout_s: float | None = None) -> list[dict]:
    """`measure_here` in a fresh subprocess (its peaks are these cases' own); `in_process` for --smoke (seconds).
    A subprocess still running after `timeout_s` is killed and the run stops, naming the cases."""
    if in_process:
        return measure_here(specs)
    try:
        return child_json([sys.executable, __file__, "--case", json.dumps(specs)], f"cases {specs} failed", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"cases {specs} did not finish in {timeout_s:.0f} s (--case-timeout-s) and were stopped") from None


def _summary(measured: dict) -> dict:
    """Medians over the rounds, and every round's figures."""
    return {"seconds": statistics.median(measured["seconds"]), "peak_bytes": statistics.median(measured["peak_bytes"]),
            "peak_mark_reset": measured["peak_mark_reset"], "rounds": {k: measured[k] for k in ("seconds", "peak_bytes")}}


# ---- tracing on fake tensors -------------------------------------------------------------------------------


def traced(spec: dict) -> dict:
    """Shapes-only run of a case: peak bytes of live tensors created during it, and bytes saved for backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        """Adds each new storage an op returns, subtracts it when it is freed; keeps the maximum."""

        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.sizes: dict[int, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    if id(storage) not in self.sizes:
                        self.sizes[id(storage)] = storage.nbytes()
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self._free, id(storage))
            return out

        def _free(self, key: int) -> None:
            self.live -= self.sizes.pop(key)

    saved: dict[int, int] = {}
    spec = {**spec, "device": "cpu"}  # shapes only: fake tensors on the CPU whatever device the case ran on

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    head = None
    if spec["part"] == "unroll":
        with torch.device("meta"):  # outside the fake mode: its parameters are swapped for fake ones below
            head = eagle3_head(spec)
    with FakeTensorMode(allow_non_fake_inputs=True):
        if head is None:
            run = attention_case(spec)
        else:
            head.to_empty(device="cpu")
            run = unroll_case(spec, head)
        with LiveBytes() as live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    result = {"traced_peak_bytes": live.peak, "saved_bytes": sum(saved.values())}
    if head is not None:
        trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
        result.update(trainable_params=trainable, frozen_params=sum(p.numel() for p in head.parameters()) - trainable)
    return result


# ---- the parts ---------------------------------------------------------------------------------------------


def part_attention(args, say) -> list[dict]:
    """Per T: the fused and the dense path side by side in one fresh process (the dense one only within budget)."""
    rows = []
    largest_dense = None  # (row) the largest dense case that ran: the estimates scale from it
    for seq in args.seqs:
        pair = []
        for path in ("fused", "dense"):
            spec = {"part": "attention", "path": path, "seq": seq, "heads": args.heads, "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim, "steps": args.steps, "repeats": args.repeats,
                    "device": getattr(args, "device", "cpu"), "dtype": getattr(args, "dtype", "float32")}
            pair.append({**spec, **traced(spec)})
        fused, dense = pair
        if largest_dense is not None:
            estimate = largest_dense["peak_bytes"] * dense["traced_peak_bytes"] / largest_dense["traced_peak_bytes"]
            basis = f"the measured dense peak at T={largest_dense['seq']} x the ratio of traced peaks"
        else:
            estimate, basis = dense["traced_peak_bytes"] * 1.5, "the traced peak x 1.5"
        ran = [fused] + ([dense] if estimate <= args.budget_gb * GIB else [])
        specs = [{k: v for k, v in row.items() if k not in ("traced_peak_bytes", "saved_bytes")} for row in ran]
        for row, measured in zip(ran, measure(specs, args.smoke, args.case_timeout_s)):
            row.update(measured=True, **_summary(measured))
            row["measured_over_traced"] = row["peak_bytes"] / row["traced_peak_bytes"]
        if len(ran) == 2:
            largest_dense = dense
        else:
            dense.update(measured=False, seconds=None, peak_bytes=estimate,
                         note=f"not run: estimated {estimate / GIB:.1f} GiB > --budget-gb {args.budget_gb}; the peak is {basis}")
        scale = HEADS_8B / args.heads
        for row in pair:
            row["scaled_to_heads"] = {"heads": HEADS_8B, "peak_gib": row["peak_bytes"] * scale / GIB,
                                      "saved_gib": row["saved_bytes"] * scale / GIB}
            rows.append(row)
            time_text = f"{row['seconds']:.1f} s" if row["seconds"] is not None else "not run (estimate)"
            say(f"  attention {row['path']:5s} T={seq:5d}: peak {row['peak_bytes'] / GIB:6.2f} GiB, saved "
                f"{row['saved_bytes'] / GIB:6.2f} GiB, {time_text}; x{scale:.0f} heads: peak {row['scaled_to_heads']['peak_gib']:.1f} GiB")
    return rows


def part_checkpoint(args, say) -> list[dict]:
    """The eagle3 unroll without and with checkpointing, side by side in one fresh process."""
    specs = [{"part": "unroll", "seq": args.unroll_seq, "hidden": args.unroll_hidden, "heads": args.heads,
              "kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate": int(3.5 * args.unroll_hidden),
              "vocab": args.vocab, "steps": args.steps, "checkpoint": checkpoint, "dtype": "float32", "repeats": args.repeats}
             for checkpoint in (False, True)]
    rows = []
    for spec, measured in zip(specs, measure(specs, args.smoke, args.case_timeout_s)):
        row = {**spec, **traced(spec), **_summary(measured)}
        row["measured_over_traced"] = row["peak_bytes"] / row["traced_peak_bytes"]
        rows.append(row)
        say(f"  eagle3 unroll T={spec['seq']} checkpoint={spec['checkpoint']!s:5s}: peak {row['peak_bytes'] / GIB:.2f} GiB "
            f"(traced {row['traced_peak_bytes'] / GIB:.2f}), {row['seconds']:.1f} s")
    return rows


def part_estimate(args, overhead: float, worst: float, say) -> list[dict]:
    """`overhead`: part B's measured / traced peak (the same unroll); `worst`: the largest of every measured case."""
    rows = []
    for seq in args.estimate_seqs:
        for checkpoint, path in ((False, "fused"), (True, "fused"), (False, "dense")):
            if path == "dense" and seq != args.estimate_seqs[0]:
                continue  # the dense path is out of reach past the first length
            spec = {"part": "unroll", "seq": seq, "hidden": args.estimate_hidden, "heads": args.estimate_heads,
                    "kv_heads": args.estimate_heads // 4, "head_dim": args.head_dim, "intermediate": args.estimate_intermediate,
                    "vocab": args.vocab, "steps": args.steps, "checkpoint": checkpoint, "dtype": "bfloat16"}
            row = {**spec, "path": path, **_traced_with_path(spec, path)}
            # traced with the draft vocabulary as the whole vocabulary (no d2t): the frozen embedding and the
            # teacher's lm_head are counted at the target's vocabulary here, the activations are the same
            embed_rows = args.estimate_target_vocab - args.vocab
            state = (row["trainable_params"] * (4 + 8) + (row["frozen_params"] + embed_rows * args.estimate_hidden) * 4
                     + args.estimate_target_vocab * args.estimate_hidden * 2)  # fp32 weights, AdamW m and v; bf16 teacher
            row["state_bytes"] = state
            row["estimated_peak_bytes"] = state + row["traced_peak_bytes"] * overhead
            row["estimated_peak_bytes_worst"] = state + row["traced_peak_bytes"] * worst
            usable = GPU_USABLE_GIB * GIB
            row["fits_80gb"] = ("yes" if row["estimated_peak_bytes_worst"] <= usable else
                                "tight" if row["estimated_peak_bytes"] <= usable else "no")
            rows.append(row)
            say(f"  8B eagle3 T={seq:5d} {path} checkpoint={checkpoint!s:5s}: activations+grads {row['traced_peak_bytes'] / GIB:6.1f} "
                f"GiB traced, state {state / GIB:.1f} GiB -> ~{row['estimated_peak_bytes'] / GIB:6.1f} GiB "
                f"(x{worst:.2f}: {row['estimated_peak_bytes_worst'] / GIB:6.1f}); fits in 80 GB: {row['fits_80gb']}")
    return rows


def _traced_with_path(spec: dict, path: str) -> dict:
    """`traced` with the eagle3 layer's TTT attention forced to the dense reference for path='dense'."""
    if path == "fused":
        return traced(spec)
    import eyas.draft.blocks as blocks
    from eyas.draft.ttt_attention import ttt_attention_reference

    blocks.ttt_attention, saved = ttt_attention_reference, blocks.ttt_attention
    try:
        return traced(spec)
    finally:
        blocks.ttt_attention = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192], help="part A's sequence lengths")
    parser.add_argument("--heads", type=int, default=4, help="query heads of parts A and B (the 8B layer has 32)")
    parser.add_argument("--kv-heads", type=int, default=1, help="kv heads (the 8B layer has 8)")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--steps", type=int, default=7, help="TTT unroll steps")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (medians reported)")
    parser.add_argument("--budget-gb", type=float, default=8.0, help="run a dense case only if its estimate is below this")
    parser.add_argument("--unroll-seq", type=int, default=2048, help="part B's sequence length")
    parser.add_argument("--unroll-hidden", type=int, default=512, help="part B's head hidden size")
    parser.add_argument("--vocab", type=int, default=DRAFT_VOCAB, help="draft vocabulary of parts B and C")
    parser.add_argument("--estimate-seqs", type=int, nargs="+", default=[8192, 16384, 32768], help="part C's lengths")
    parser.add_argument("--device", default="cpu", help="part A's device: cpu, or cuda (peak from torch.cuda.max_memory_allocated)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="part A's dtype (on CUDA the fused path needs bfloat16; fp32 falls back to the dense one)")
    add_report_args(parser, "bench_long_context.json", "seconds: tiny shapes, the same code paths")
    parser.add_argument("--case-timeout-s", type=float, default=None,
                        help="stop a case's subprocess after this many seconds (default: no limit)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run these cases in this (fresh) process
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(measure_here(json.loads(args.case))))
        return 0
    args.estimate_hidden, args.estimate_heads, args.estimate_intermediate = HIDDEN_8B, HEADS_8B, INTERMEDIATE_8B
    args.estimate_target_vocab = VOCAB_8B
    apply_smoke(args, "bench_long_context", target=False, seqs=[64, 128, 256], heads=2, kv_heads=1, head_dim=16,
                unroll_seq=64, unroll_hidden=32, vocab=256, budget_gb=0.004, repeats=1, estimate_seqs=[64, 128],
                estimate_hidden=32, estimate_heads=4, estimate_intermediate=64, estimate_target_vocab=512)

    def say(text: str) -> None:
        print(text, flush=True)

    started = time.perf_counter()
    say(f"A. TTT attention, {args.heads}/{args.kv_heads} heads x {args.head_dim}, {args.steps} steps, {args.dtype}, batch 1")
    attention = part_attention(args, say)
    say(f"B. eagle3 unroll with and without checkpointing, T={args.unroll_seq}, fp32")
    checkpointing = part_checkpoint(args, say)
    overhead = max(1.0, max(row["measured_over_traced"] for row in checkpointing))
    worst = max([overhead] + [row["measured_over_traced"] for row in attention if row["measured"]])
    say(f"C. the 8B eagle3 draft, bf16 autocast, traced on fake tensors (x{overhead:.2f}: part B's measured / traced; "
        f"x{worst:.2f}: the largest of all cases)")
    estimate = part_estimate(args, overhead, worst, say)

    def peak(path: str, seq: int) -> dict:
        return next(r for r in attention if r["path"] == path and r["seq"] == seq)

    low, high = min(args.seqs), max(args.seqs)
    fused_ratio = peak("fused", high)["peak_bytes"] / peak("fused", low)["peak_bytes"]
    dense_ratio = peak("dense", high)["peak_bytes"] / peak("dense", low)["peak_bytes"]
    dense_measured = peak("dense", high)["measured"]
    plain, ckpt = checkpointing
    figures = {
        f"ttt_peak_memory_ratio_{high}_vs_{low}": fused_ratio,
        f"ttt_dense_peak_memory_ratio_{high}_vs_{low}": dense_ratio,
        "ttt_dense_over_fused_peak_memory_at_low": peak("dense", low)["peak_bytes"] / peak("fused", low)["peak_bytes"],
        "ttt_dense_over_fused_time_at_low": (peak("dense", low)["seconds"] / peak("fused", low)["seconds"]
                                             if peak("dense", low)["measured"] else None),
        "checkpoint_peak_memory_ratio": ckpt["peak_bytes"] / plain["peak_bytes"],
        "checkpoint_time_ratio": ckpt["seconds"] / plain["seconds"],
        "measured_over_traced_peak": overhead,
        "measured_over_traced_peak_worst": worst,
    }
    report = {**environment("transformers"), "seconds": time.perf_counter() - started,
              "settings": {k: v for k, v in vars(args).items() if k != "case"}, "figures": figures,
              "attention": attention, "checkpointing": checkpointing, "estimate_8b": estimate}
    out = write_json(output_path(args.out, RESULTS, args.smoke), report, newline=False)
    say(f"wrote {out} ({report['seconds']:.0f} s)")
    time_ratio = figures["ttt_dense_over_fused_time_at_low"]
    bench_lines(f"ttt_peak_memory_ratio_{high}_vs_{low} {fused_ratio:.2f} ratio",
                f"ttt_dense_peak_memory_ratio_{high}_vs_{low}{'' if dense_measured else '_estimated'} {dense_ratio:.2f} ratio",
                f"ttt_dense_over_fused_peak_memory_{low} {figures['ttt_dense_over_fused_peak_memory_at_low']:.2f} ratio",
                *([f"ttt_dense_over_fused_time_{low} {time_ratio:.2f} ratio"] if time_ratio is not None else []),
                f"checkpoint_unroll_peak_memory_ratio {figures['checkpoint_peak_memory_ratio']:.2f} ratio",
                f"checkpoint_unroll_time_ratio {figures['checkpoint_time_ratio']:.2f} ratio",
                *(f"est_8b_eagle3_peak_{row['seq']}_{row['path']}{'_ckpt' if row['checkpoint'] else ''} "
                  f"{row['estimated_peak_bytes'] / GIB:.1f} GiB" for row in estimate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
