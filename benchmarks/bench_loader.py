"""Loader benchmark: batches per second of the trainer's shard loader at 8B shapes, old path vs new,
against what a GPU step at those shapes consumes.

Run: `python benchmarks/bench_loader.py` (about 4 minutes on 2 CPU cores; `--batches`, `--workers`,
`--repeats` for other settings; `--smoke`: tiny shapes, seconds). Writes
benchmarks/results/bench_loader.json.

Shards: synthetic, written with eyas's writer (`encode` + `write_shard` + the dump's
`finalize_split`) at Llama-3.1-8B shapes: hidden 4096, eagle3's three fused layers plus the last
hidden state, fp8 with per-token scales, vocabulary 128256 (int32 ids), samples of 128-2048
tokens, enough for `--batches` batches of 8192 tokens. Read from the page cache (written just
before), checked as the trainer checks them (each sample's CRC-32 at its first read; every run
opens a fresh reader, so each run is a first epoch).

Side by side, interleaved, `--repeats` times each, OMP_NUM_THREADS=1 (what `accelerate launch`
sets), one epoch per run, the rate taken from the first batch received to the last (worker
start-up excluded), medians:
  - old: the loader before `eyas.train.loader`: one read-ahead thread (prefetch 2) reads each
         sample and decodes it fp8 -> fp32 on the CPU, then pads the fp32 batch;
  - new: `BatchStream` with `--workers` DataLoader workers that slice and pad the stored codes,
         and `to_device` decoding them on the "device", the CPU here, in the consuming thread;
  - new, codes: the same stream, the batches taken as codes (what crosses to a GPU, where the
         decode is one elementwise kernel over 134 MB: about a millisecond, not measured here).
Demand: what a trainer at 8B shapes consumes, an estimate: model FLOPs per token of the eagle3
head at those shapes (benchmarks/bench_train.py's count: forward matmuls and attention x3 on the
trained path, the teacher's lm_head x1; draft vocabulary 32000, `--ttt` unrolled steps, samples
of the mean length) at an assumed 400 TFLOP/s (H100 dense bf16, 989 TFLOP/s peak, at ~40% MFU).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: what `accelerate launch` sets

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_train import model_flops  # noqa: E402  (benchmarks/bench_train.py)
from machine import add_report_args, apply_smoke, environment, output_path, publish, stamp, write_synthetic_dump  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_loader.json"
GPU_FLOPS = 400e12  # assumed effective rate: H100 dense bf16 (989 TFLOP/s peak) at ~40% MFU
TARGET_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256}


class DecodedOnly:
    """A reader without `codes`: the loader then reads decoded samples, as it did before (the old path)."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.lengths = reader.lengths

    def __len__(self) -> int:
        return len(self.reader)

    def sample(self, i: int) -> dict:
        return self.reader.sample(i)


def one_run(directory: Path, path: str, args: argparse.Namespace) -> dict:
    """One epoch through one path; tokens/s from the first batch received to the last."""
    from eyas.data.shard_reader import ShardReader
    from eyas.train.loader import BatchStream, TokenBudgetLoader, stored_bytes, to_device

    reader = ShardReader(directory)
    if path == "old":
        stream = BatchStream(TokenBudgetLoader(DecodedOnly(reader), args.token_budget, seed=0), prefetch=2, workers=0)
    else:
        stream = BatchStream(TokenBudgetLoader(reader, args.token_budget, seed=0), prefetch=2, workers=args.workers)
    batches = len(stream.loader)
    padded = real = 0
    sent = 0
    try:
        for taken in range(batches):
            batch, _ = next(stream)
            if taken == 0:
                start = time.perf_counter()
                sent = stored_bytes(batch)
                continue
            if path == "new":
                batch = to_device(batch, torch.device("cpu"))  # the decode, on the CPU as the "device"
            padded += batch["attention_mask"].numel()
            real += int(batch["attention_mask"].sum())
        elapsed = time.perf_counter() - start
    finally:
        stream.close()
    return {"tokens_per_s": padded / elapsed, "real_tokens_per_s": real / elapsed, "seconds": elapsed,
            "batches": batches, "bytes_to_device_first_batch": sent}


def gpu_demand(lengths: np.ndarray, ttt: int) -> dict:
    """Tokens/s a GPU trainer consumes at 8B shapes: model FLOPs per token at an assumed rate (an estimate)."""
    from transformers import LlamaConfig

    from eyas.draft.features import default_layers
    from eyas.draft.registry import head_class
    from eyas.recipe_schema import DraftConfig

    target = LlamaConfig(**TARGET_8B)
    head = head_class("eagle3").head_config(DraftConfig(kind="eagle3"), target, default_layers(32), 32000, "")
    seq = int(round(float(np.mean(lengths))))
    per_token = model_flops(head.to_dict(), seq, ttt, head.train_lm_head) / seq
    return {"flops_per_token": per_token, "mean_sample_tokens": seq, "assumed_gpu_flops_per_s": GPU_FLOPS,
            "tokens_per_s": GPU_FLOPS / per_token, "ttt_steps": ttt, "draft_vocab": 32000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="batches of --token-budget tokens in the dump")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the features (Llama-3.1-8B: 4096)")
    parser.add_argument("--vocab", type=int, default=128256, help="target vocabulary (Llama-3.1-8B: 128256; int32 ids)")
    parser.add_argument("--workers", type=int, default=2, help="loader workers of the new path")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttt", type=int, default=7, help="unrolled draft steps in the demand estimate")
    add_report_args(parser, "bench_loader.json", "tiny shapes, one repeat: tests the plumbing")
    args = parser.parse_args(argv)
    apply_smoke(args, "bench_loader", target=False, batches=4, token_budget=512, hidden=64, repeats=1)
    torch.set_num_threads(1)
    out = output_path(args.out, RESULTS, args.smoke)
    rng = np.random.default_rng(0)
    low, high = (128, 2048) if not args.smoke else (16, 128)
    lengths = rng.integers(low, high + 1, size=4 * args.batches * args.token_budget // low)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), args.batches * args.token_budget)) + 1]
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-loader-"))
    try:
        started = time.perf_counter()
        # fp8 eagle3 shards (three fused layers + last hidden) of random bf16 features
        write_synthetic_dump(root / "shards", lengths, args.hidden, args.vocab, 4 * args.token_budget, [2, 16, 29],
                             "bench-loader-plan", dtype=torch.bfloat16)
        write_s = time.perf_counter() - started
        print(f"bench_loader: wrote {len(lengths)} samples, {int(lengths.sum())} tokens in {write_s:.0f} s", flush=True)
        runs: dict[str, list[dict]] = {"old": [], "new": [], "new_codes": []}
        for rep in range(args.repeats):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for path in order:
                runs[path].append(one_run(root / "shards", path, args))
                print(f"bench_loader: rep {rep} {path}: {runs[path][-1]['tokens_per_s']:.0f} tokens/s "
                      f"({runs[path][-1]['batches']} batches)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rate = {path: statistics.median(r["tokens_per_s"] for r in found) for path, found in runs.items()}
    demand = gpu_demand(lengths, args.ttt)
    figures = {
        "loader_tokens_per_s_old": rate["old"], "loader_tokens_per_s_new": rate["new"],
        "loader_tokens_per_s_new_codes": rate["new_codes"], "new_vs_old": rate["new"] / rate["old"],
        "new_codes_vs_old": rate["new_codes"] / rate["old"],
        "gpu_demand_tokens_per_s_estimate": demand["tokens_per_s"],
        "gpu_step_s_estimate": args.token_budget / demand["tokens_per_s"],
        "loader_vs_gpu_step_demand": rate["new_codes"] / demand["tokens_per_s"],
        "old_loader_vs_gpu_step_demand": rate["old"] / demand["tokens_per_s"],
        "bytes_to_device_per_batch_old": runs["old"][0]["bytes_to_device_first_batch"],
        "bytes_to_device_per_batch_new": runs["new"][0]["bytes_to_device_first_batch"],
        "write_s": write_s,
    }
    report = {
        "figures": figures, "runs": runs, "demand": demand,
        "settings": vars(args) | {"encoding": "fp8", "features": "eagle3: aux_hidden x3 + last_hidden",
                                  "sample_tokens": [low, high], "samples": len(lengths), "tokens": int(lengths.sum()),
                                  "omp_num_threads": os.environ["OMP_NUM_THREADS"], "verify": True, "prefetch": 2},
        **environment("safetensors"), "date": stamp(),
    }
    lines = [f"loader_tokens_per_s_{path} {rate[path]:.0f} tokens/s" for path in ("new", "new_codes", "old")]
    lines += [f"loader_{name} {figures[name]:.2f} ratio" for name in ("new_vs_old", "new_codes_vs_old")]
    lines += [f"loader_gpu_demand_estimate {demand['tokens_per_s']:.0f} tokens/s",
              f"loader_vs_gpu_step_demand {figures['loader_vs_gpu_step_demand']:.2f} ratio"]
    publish(out, report, lines, "bench_loader", newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
