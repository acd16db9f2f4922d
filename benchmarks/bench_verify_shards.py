"""Shard verification benchmark: what checking the shards costs the trainer, side by side with no check.

Run: `python benchmarks/bench_verify_shards.py` (2-4 minutes on 2 CPU cores; `--samples`,
`--hidden`, `--repeats` for other sizes). Writes benchmarks/results/bench_verify_shards.json.
`--smoke`: seconds (16 samples, hidden 64, one repeat), its JSON in a temp folder (or --out).

A synthetic dump shaped like the quickstart's (SmolLM2 hidden 576, eagle3: three fused layers
plus the last hidden state, fp8 with per-token scales, 16,384-token shards, samples of 64-320
tokens) is written once; then, interleaved, `--repeats` times each:

- time to first batch (open the dump, build the TokenBudgetLoader, read its first batch of
  `--token-budget` tokens) with verification off (`ShardReader(verify=False)`: sizes only, the
  reader before issue 15), on (the default: headers of every shard at open, offsets at a shard's
  first read, each sample's CRC-32 at its first read), and `legacy` (shards without per-sample
  checksums, which the reader hashes whole, sha256, at their first read);
- the first `--batches` batches (every sample read for the first time, so every one is
  checked), verification off and on;
- `eyas verify`'s full check (`eyas.data.shard_verify.verify`).

Files are read from the page cache (written just before), so the ratios are CPU costs; a cold
disk adds the same read time to both sides, except for `legacy`, which reads whole shards.
Ratios are medians over repeats of per-repeat ratios of process CPU time (all threads), which a
shared machine's load disturbs less than wall time; wall-time ratios are recorded beside them.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import machine  # benchmarks/machine.py
import numpy as np
import torch

RESULTS = Path(__file__).parent / "results" / "bench_verify_shards.json"


def write_dump(directory: Path, samples: int, hidden: int, shard_tokens: int, seed: int = 0) -> dict:
    """A dump of random features with the layout `eyas dump` writes (fp8, eagle3 + last hidden), samples of
    64-320 tokens, SmolLM2's vocabulary."""
    lengths = np.random.default_rng(seed).integers(64, 321, size=samples)
    return machine.write_synthetic_dump(directory, lengths, hidden, 49152, shard_tokens, [2, 15, 27], "benchmark-plan", seed=seed)


def legacy_copy(source: Path, target: Path) -> None:
    """The same dump without per-sample checksums (as written before them)."""
    from safetensors import safe_open
    from safetensors.torch import save

    from eyas.data.dump import finalize_split
    from eyas.data.shard_format import CHECKSUM

    def without_checksums(path: Path) -> dict:
        """The shard at `path` written again without its per-sample checksums; its new size and sha256."""
        with safe_open(str(path), "pt") as f:
            payload = save({k: f.get_tensor(k) for k in f.keys() if k != CHECKSUM}, metadata=f.metadata())
        path.write_bytes(payload)
        return {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}

    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    for record in manifest["shards"]:
        record.update(without_checksums(target / record["file"]))
        (target / record["file"]).with_suffix(".json").write_text(json.dumps(record))
    header = {k: v for k, v in manifest.items() if k not in ("shards", "index", "plan")}
    finalize_split(target, len(manifest["shards"]), header, wait=False, plan=manifest["plan"])


def read_batches(directory: Path, verify: bool, token_budget: int, batches: int) -> machine.Clock:
    """Open the dump, build the loader, read `batches` batches (1: the time to first batch)."""
    from eyas.data.shard_reader import ShardReader
    from eyas.train.loader import TokenBudgetLoader

    gc.collect()  # the previous measurement's readers are freed here, not inside this one
    with machine.Clock() as clock:
        reader = ShardReader(directory, expect_identity="synthetic", verify=verify)
        for taken, batch in enumerate(TokenBudgetLoader(reader, token_budget=token_budget, seed=0), 1):
            assert batch["aux_hidden"].shape[0] >= 1
            if taken == batches:
                break
    return clock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=640, help="samples of 64-320 tokens")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2: 576)")
    parser.add_argument("--shard-tokens", type=int, default=16384, help="dump.shard_tokens (quickstart: 16384)")
    parser.add_argument("--token-budget", type=int, default=2048, help="train.token_budget (quickstart: 2048)")
    parser.add_argument("--batches", type=int, default=12, help="batches read in the second measurement")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic dump")
    machine.add_report_args(parser, "bench_verify_shards.json", "seconds: 16 samples, hidden 64, one repeat")
    args = parser.parse_args(argv)
    machine.apply_smoke(args, "bench_verify_shards", target=False, samples=16, hidden=64, shard_tokens=1024,
                        token_budget=512, batches=2, repeats=1)
    out = machine.output_path(args.out, RESULTS, args.smoke)
    torch.manual_seed(0)

    from eyas.data.shard_verify import verify

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-verify-"))
    current, legacy = root / "shards", root / "legacy"
    manifest = write_dump(current, args.samples, args.hidden, args.shard_tokens)
    legacy_copy(current, legacy)
    for d in (current, legacy):  # warm the page cache and the imports
        read_batches(d, True, args.token_budget, 2)

    runs: dict[str, list[machine.Clock]] = {k: [] for k in ("first_off", "first_on", "first_legacy", "batches_off",
                                                             "batches_on", "verify_full")}
    for repeat in range(args.repeats):  # interleaved, so load on the shared machine hits every variant alike
        order = [False, True] if repeat % 2 == 0 else [True, False]  # and alternated: no variant always goes first
        for verify_on in order:
            key = "first_on" if verify_on else "first_off"
            runs[key].append(read_batches(current, verify_on, args.token_budget, 1))
        runs["first_legacy"].append(read_batches(legacy, True, args.token_budget, 1))
        for verify_on in order:
            runs["batches_on" if verify_on else "batches_off"].append(
                read_batches(current, verify_on, args.token_budget, args.batches))
        gc.collect()
        with machine.Clock() as clock:
            assert verify(current) == []
        runs["verify_full"].append(clock)

    med = machine.medians(runs)
    dump_bytes = manifest["bytes"]
    # the ratios: verification on (or legacy) over off, within each repeat
    figures = {
        "time_to_first_batch_verify_off_s": med["first_off"],
        "time_to_first_batch_verify_on_s": med["first_on"],
        "time_to_first_batch_verify_vs_off": machine.paired(runs["first_on"], runs["first_off"]),
        "time_to_first_batch_verify_vs_off_wall": machine.paired(runs["first_on"], runs["first_off"], "wall"),
        "time_to_first_batch_legacy_sha256_vs_off": machine.paired(runs["first_legacy"], runs["first_off"]),
        "first_batches_verify_vs_off": machine.paired(runs["batches_on"], runs["batches_off"]),
        "first_batches_verify_vs_off_wall": machine.paired(runs["batches_on"], runs["batches_off"], "wall"),
        "verify_full_gb_per_s": dump_bytes / med["verify_full"] / 1e9,
    }
    units = {"time_to_first_batch_verify_off_s": "s", "time_to_first_batch_verify_on_s": "s",
             "verify_full_gb_per_s": "GB/s"}
    machine.publish(out, {
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "wall_seconds": {k: [round(c.wall, 4) for c in v] for k, v in runs.items()},
        "cpu_seconds": {k: [round(c.cpu, 4) for c in v] for k, v in runs.items()},
        "ratios_use": "median over repeats of per-repeat ratios (verification on / off) of process CPU time, unless "
                      "the name ends in _wall; warm page cache",
        "settings": {"samples": args.samples, "tokens": manifest["num_tokens"], "hidden": args.hidden,
                     "encoding": "fp8", "features": "aux_hidden x3 + last_hidden", "shards": len(manifest["shards"]),
                     "shard_tokens": args.shard_tokens, "dump_bytes": dump_bytes, "token_budget": args.token_budget,
                     "batches": args.batches, "repeats": args.repeats, "smoke": args.smoke},
        **machine.environment("safetensors", "numpy"),
    }, machine.figure_lines(figures, units), "bench_verify_shards")
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
