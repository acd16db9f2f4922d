"""Trainer benchmark: an eagle3 head shaped for SmolLM2-135M, trainer vs bare forward+backward.

Run: `python benchmarks/bench_train.py` (about 5-8 minutes on 2 CPU cores; `--steps`, `--seq`,
`--mixed-precision bf16` for other settings; `--smoke`: seconds, a tiny target, 64-token sequences,
one timed step, its JSON in a temp folder or --out).

Shapes: hidden 576, 9 heads / 3 kv heads, target vocabulary 49152, draft vocabulary 32000,
TTT 7 steps, sequences of 1024 tokens (one per micro-batch), forward-KL loss against the
teacher recomputed through SmolLM2's lm_head over the draft vocabulary, draft lm_head trained.

Side by side in one process on the same head, interleaved, medians over `--steps` timed steps
after one warm-up step each:
  - trainer: `Trainer.train_step` exactly as `eyas train` runs it: batches read from real int8
             shards (SmolLM2 run over Python standard-library source, `eyas prepare` + `eyas dump`)
             by the prefetching loader, teacher, 7-step unroll, loss, backward, clipping, AdamW,
             scheduler (a step that is not logged: its metrics are read after the timing);
  - bare:    the same module's forward (teacher + unroll + loss) and backward on a batch already in
             memory: no data loading, no optimizer, no bookkeeping.
Also: achieved FLOP/s of the trainer (model FLOPs counted from the shapes: forward matmuls and
attention, x3 for the trained path, x1 for the frozen teacher) against a measured matmul peak
of this machine (median of square matmuls of the same dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import add_report_args, apply_smoke, environment, output_path, publish, set_threads, stamp

from eyas.cpus import available_cpus

RESULTS = Path(__file__).parent / "results" / "bench_train.json"


def stdlib_rows(count: int, min_chars: int = 12000) -> list[dict]:
    """Plain-text rows from the Python standard library's own source files (long enough to fill 1024 tokens)."""
    import sysconfig

    folder = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for path in sorted(folder.glob("*.py")):
        text = path.read_text(errors="ignore")
        if len(text) >= min_chars:
            rows.append({"id": path.name, "text": text})
        if len(rows) == count:
            break
    return rows


def build_run(root: Path, samples: int, seq: int, ttt: int, draft_vocab: int, mixed_precision: str,
              target: str = "smollm2-135m-instruct"):
    """Prepare + dump `samples` sequences of `seq` tokens on the target (int8 shards), return the recipe."""
    from eyas.config import load_recipe
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare

    source = root / "stdlib.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in stdlib_rows(samples)) + "\n")
    recipe = load_recipe(None, [
        f"target.path={target}", f"run.output_dir={root}", "run.name=bench", f"data.source={source}", "data.format=text",
        f"data.max_length={seq}", "data.overflow=truncate", "data.heldout_fraction=0.0",
        f"dump.token_budget={seq}", "dump.encoding=int8", f"dump.draft_vocab_size={draft_vocab}",
        "draft.kind=eagle3", f"train.ttt_steps={ttt}", f"train.token_budget={seq}", "train.grad_accum=1",
        f"train.mixed_precision={mixed_precision}", "train.max_steps=1000", "train.warmup_steps=10",
        "train.loss=forward_kl", "train.prefetch=2", "train.logger=none", "train.resume=false",
    ])
    prepare(recipe)
    dump(recipe)
    return recipe


def model_flops(cfg: dict, seq: int, steps: int, train_lm_head: bool = True) -> float:
    """FLOPs of one trained sequence: forward matmuls/attention x3 on the trained path, teacher x1."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    vocab_draft = cfg["draft_vocab_size"]
    layer = 2 * seq * (2 * hidden * q_dim + 2 * 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * inter)
    attention = 2 * 2 * seq * seq * q_dim  # scores + weighted values over the context block
    lm_head = 2 * seq * hidden * vocab_draft
    fc = 2 * seq * 3 * hidden * hidden
    trained = fc + steps * (layer + attention) + steps * lm_head * (1 if train_lm_head else 0)
    frozen_lm_head = 0 if train_lm_head else steps * lm_head  # forward + input grad only: x2
    teacher = 2 * seq * hidden * vocab_draft
    return 3 * trained + 2 * frozen_lm_head + teacher


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 7) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times)


def bare_step(trainer, batch: dict) -> None:
    """The same module's forward (teacher + unroll + loss) and backward; nothing else."""
    steps = trainer.setup.train_steps
    out = trainer.setup.model(batch, trainer.setup.teacher, steps, trainer.setup.mix, token_feed=trainer.setup.token_feed)
    counts = [c.clamp(min=1.0) for c in out["counts"]]
    loss = sum(w * s / c for w, s, c in zip(trainer.setup.weights, out["loss_sums"], counts))
    loss.backward()


def run(args: argparse.Namespace) -> dict:
    from eyas.train.loader import BatchStream, to_device
    from eyas.train.loop import Trainer

    set_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-train-"))
    started = time.perf_counter()
    recipe = build_run(root, args.steps + 2, args.seq, args.ttt, args.draft_vocab, args.mixed_precision, args.target)
    setup_s = time.perf_counter() - started
    trainer = Trainer(recipe)
    stream = BatchStream(trainer.setup.loader, recipe.train.prefetch)
    fixed = to_device(next(iter(trainer.make_loader(trainer.setup.source.train_reader, shuffle=False))), trainer.setup.device)
    trained, bare = [], []
    for rep in range(args.steps + 1):  # the first of each is a warm-up
        start = time.perf_counter()
        sums = trainer.train_step([next(stream)])
        elapsed = time.perf_counter() - start
        metrics = trainer.step_metrics(sums)  # read after the timing: the loop reads its sums at log steps only
        if rep:
            trained.append((elapsed, metrics["tokens"]))
        start = time.perf_counter()
        bare_step(trainer, fixed)
        elapsed = time.perf_counter() - start
        trainer.setup.optimizer.zero_grad(set_to_none=True)
        if rep:
            bare.append(elapsed)
        print(f"bench_train: rep {rep}: trainer {trained[-1][0] if rep else float('nan'):.2f} s, "
              f"bare {elapsed:.2f} s, loss {metrics['loss']:.3f}", flush=True)
    stream.close()
    tokens = statistics.median(t for _, t in trained)
    trainer_s = statistics.median(s for s, _ in trained)
    bare_s = statistics.median(bare)
    dtype = torch.bfloat16 if trainer.setup.accelerator.mixed_precision == "bf16" else torch.float32
    peak = matmul_peak(dtype, size=256 if args.smoke else 2048)
    flops = model_flops(trainer.setup.head_config.to_dict(), args.seq, args.ttt, trainer.setup.head_config.train_lm_head)
    return {
        "trainer_tokens_per_s": tokens / trainer_s,
        "bare_tokens_per_s": args.seq / bare_s,
        "trainer_vs_bare": (tokens / trainer_s) / (args.seq / bare_s),
        "trainer_step_s": trainer_s, "bare_step_s": bare_s,
        "trainer_steps_s": [s for s, _ in trained], "bare_steps_s": bare,
        "model_flops_per_sequence": flops,
        "achieved_flops_per_s": flops * (tokens / args.seq) / trainer_s,
        "matmul_peak_flops_per_s": peak,
        "fraction_of_matmul_peak": flops * (tokens / args.seq) / trainer_s / peak,
        "setup_s": setup_s,
        "dtype": str(dtype),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--mixed-precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=available_cpus())
    parser.add_argument("--target", default="smollm2-135m-instruct")
    add_report_args(parser, "bench_train[_bf16].json", "seconds: tiny target, 64-token sequences, TTT 2, one timed step")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    apply_smoke(args, "bench_train", steps=1, seq=64, ttt=2, draft_vocab=64)
    figures = run(args)

    report = {
        "figures": figures,
        "settings": vars(args) | ({} if args.smoke else {"hidden": 576, "target_vocab": 49152, "target": "SmolLM2-135M-Instruct"})
        | {"loss": "forward_kl", "draft_lm_head": "trained", "shards": "int8"},
        **environment("transformers", "accelerate"), "date": stamp(),
    }
    tag = "" if args.mixed_precision == "fp32" else f"_{args.mixed_precision}"  # the file's suffix too
    publish(output_path(args.out, RESULTS.with_name(f"bench_train{tag}.json"), args.smoke), report, [
        f"train_tokens_per_s{tag} {figures['trainer_tokens_per_s']:.1f} tokens/s",
        f"train_vs_bare_fwd_bwd{tag} {figures['trainer_vs_bare']:.3f} ratio",
        f"train_achieved_flops{tag} {figures['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s",
        f"train_fraction_of_matmul_peak{tag} {figures['fraction_of_matmul_peak']:.3f} ratio"], "bench_train", newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
