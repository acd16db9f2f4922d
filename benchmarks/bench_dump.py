"""Dump benchmark: throughput against the bare decoder stack, bytes per token, time to first batch.

Run: `python benchmarks/bench_dump.py` (about 5 minutes on 2 idle CPU cores, where SmolLM2 runs at a
few hundred tokens/s; `--samples`, `--max-length`, `--repeats` for a longer run).

1. Throughput, side by side on the same SmolLM2 batches (chitchat conversations, prepared once),
   interleaved runs, medians:
   - body:  the bare forward of the target's decoder stack (no lm_head) over pre-built padded
            batches: the limit for any dump;
   - eyas:  `eyas dump` (hooks, int8 encoding, shard writes with sha256, manifest, vocabulary);
   - ohs:   the same dump path but capturing layers with `output_hidden_states=True`;
   - naive: the full model forward with `output_hidden_states=True` (lm_head included) and each
            sample's bf16 tensors saved with torch.save as they come (the anchors' way).
2. Bytes per token against the anchors' layout (4 x hidden x 2 bytes), for several encodings, with
   the reconstruction error of each against the bf16 features (relative RMS error per layer).
3. Time to first batch (open the manifest, build the loader, read the first batch) on synthetic
   dumps of 1,000 / 10,000 / 100,000 samples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from machine import machine, versions  # benchmarks/machine.py

RESULTS = Path(__file__).parent / "results" / "bench_dump.json"


def _recipe(root: Path, name: str, samples: int, max_length: int, *extra: str):
    from eyas.config import load_recipe

    return load_recipe(None, [
        f"run.output_dir={root}", f"run.name={name}", "data.source=chitchat", f"data.max_samples={samples}",
        f"data.max_length={max_length}", "data.heldout_fraction=0.0", "dump.token_budget=2048",
        "dump.shard_tokens=65536", *extra,
    ])


def _fresh_run(root: Path, name: str, prepared: Path, samples: int, max_length: int, *extra: str):
    recipe = _recipe(root, name, samples, max_length, *extra)
    shutil.rmtree(recipe.run_dir, ignore_errors=True)
    shutil.copytree(prepared, recipe.run_dir / "prepared")
    return recipe


def _batches(dataset, dump_cfg) -> list[tuple[torch.Tensor, list[int]]]:
    """The dump's own batches (same plan), padded, built ahead of time for the baselines."""
    from eyas.data.dump import pad_right, plan_shards, sample_lengths
    from eyas.data.shards import budget_batches

    lengths = sample_lengths(dataset)
    out = []
    for shard in plan_shards(lengths, dump_cfg.shard_tokens):
        rows = dataset[[int(i) for i in shard]]["input_ids"]
        for batch in budget_batches(np.arange(len(shard)), lengths[shard], dump_cfg.token_budget):
            out.append((pad_right([rows[i] for i in batch]), [len(rows[i]) for i in batch]))
    return out


class Clock:
    """Wall time and this process's CPU time (all threads): on a shared machine the CPU time of
    a pass varies far less than its wall time, which other users' jobs stretch."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def time_body(model, batches) -> Clock:
    decoder = model.get_decoder()
    with Clock() as clock, torch.inference_mode():
        for ids, _ in batches:
            decoder(input_ids=ids, use_cache=False)
    return clock


def time_naive(model, batches, layers: list[int], out_dir: Path) -> Clock:
    """Full forward with all hidden states; each sample's tensors torch.save'd as they come."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    n = 0
    with Clock() as clock, torch.inference_mode():
        for ids, lengths in batches:
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            hs = out.hidden_states
            for b, length in enumerate(lengths):
                torch.save({
                    "input_ids": ids[b, :length].clone(),
                    "aux_hidden_state": torch.cat([hs[i][b, :length] for i in layers], -1).to(torch.bfloat16),
                    "hidden_state": hs[-1][b, :length].to(torch.bfloat16).clone(),
                }, out_dir / f"data_{n}.ckpt")
                n += 1
    return clock


def time_dump(recipe, model, tokenizer, use_output_hidden_states: bool = False) -> tuple[Clock, float, dict]:
    """A whole `eyas dump`; also returns the share of its wall time spent inside the target's forward."""
    from eyas.data import dump as dump_module

    shutil.rmtree(recipe.run_dir / "shards", ignore_errors=True)
    original = dump_module.HiddenCapture.__call__
    inside = [0.0]

    def via_ohs(self, input_ids):
        out = self.decoder(input_ids=input_ids, use_cache=False, output_hidden_states=True)
        return [out.hidden_states[i] for i in self.aux_layers], out.last_hidden_state

    forward = via_ohs if use_output_hidden_states else original

    def timed(self, input_ids):
        start = time.perf_counter()
        result = forward(self, input_ids)
        inside[0] += time.perf_counter() - start
        return result

    dump_module.HiddenCapture.__call__ = timed
    try:
        with Clock() as clock:
            manifest = dump_module.dump(recipe, model=model, tokenizer=tokenizer)
        return clock, inside[0] / clock.wall, manifest
    finally:
        dump_module.HiddenCapture.__call__ = original


def reconstruction_error(shard_dir: Path, reference_dir: Path, limit: int = 40) -> dict:
    """Relative RMS error per feature block against the bf16 dump (same samples, same order)."""
    from eyas.data.shards import ShardReader

    test, ref = ShardReader(shard_dir), ShardReader(reference_dir)
    errors: dict[str, list[float]] = {}
    for i in range(min(limit, len(ref))):
        a, b = test.sample(i), ref.sample(i)
        for key in ("aux_hidden", "last_hidden"):
            if key not in a:
                continue
            blocks = a[key].shape[-1] // ref.manifest["hidden_size"]
            for j, (x, y) in enumerate(zip(a[key].chunk(blocks, -1), b[key].chunk(blocks, -1))):
                name = f"{key}.{j}" if key == "aux_hidden" else key
                errors.setdefault(name, []).append(float((x - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt()))
    return {k: round(statistics.median(v), 5) for k, v in errors.items()}


def first_batch_times(root: Path, counts: list[int], repeats: int) -> dict:
    """Synthetic dumps of tiny samples: open + loader + first batch, median over repeats."""
    from eyas.data.dump import finalize_split
    from eyas.data.shards import SCHEMA_VERSION, ShardReader, TokenBudgetLoader, encode, write_shard

    hidden, length, per_shard = 64, 4, 25000
    results = {}
    for count in counts:
        directory = root / f"synthetic-{count}"
        shards = [list(range(s, min(s + per_shard, count))) for s in range(0, count, per_shard)]
        directory.mkdir(parents=True, exist_ok=True)
        for k, ids in enumerate(shards):
            tokens = len(ids) * length
            feats = torch.randn(tokens, hidden)
            write_shard(directory, k, {
                "input_ids": torch.randint(0, 1000, (tokens,), dtype=torch.int32),
                "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                "offsets": torch.arange(0, tokens + 1, length, dtype=torch.int64),
                "sample_index": torch.tensor(ids, dtype=torch.int64),
                **{f"aux_hidden.{j}{s}": t for j in range(3) for s, t in encode(feats, "int8").items()},
                **{f"last_hidden{s}": t for s, t in encode(feats, "int8").items()},
            }, {"shard": k})
        header = {"schema_version": SCHEMA_VERSION, "target_identity": "synthetic", "target_path": "none",
                  "hidden_size": hidden, "layers": [2, 3, 4], "encoding": "int8",
                  "features": {"aux_hidden": {"layers": [2, 3, 4], "encodings": ["int8"] * 3},
                               "last_hidden": {"encoding": "int8"}}}
        finalize_split(directory, len(shards), header, wait=False)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            reader = ShardReader(directory, expect_identity="synthetic")
            batch = next(iter(TokenBudgetLoader(reader, token_budget=512, seed=0)))  # 128 samples
            times.append(time.perf_counter() - start)
            assert batch["aux_hidden"].shape[-1] == 3 * hidden
        results[count] = statistics.median(times)
        shutil.rmtree(directory)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60, help="chitchat conversations read (about half have an answer)")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per sample (longer ones are truncated)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from eyas.config import TargetConfig
    from eyas.data.dump import feature_spec
    from eyas.data.prepare import load_prepared, prepare
    from eyas.targets import load_target

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-dump-"))
    model, tokenizer = load_target(TargetConfig())
    base = _recipe(root, "base", args.samples, args.max_length)
    prepare(base, tokenizer=tokenizer)
    prepared = base.run_dir / "prepared"
    dataset = load_prepared(base.run_dir, "train")
    tokens = sum(len(x) for x in dataset["input_ids"])
    batches = _batches(dataset, base.dump)
    layers = feature_spec(base, model.config)["aux_layers"]
    print(f"bench_dump: {len(dataset)} samples, {tokens} tokens, {len(batches)} batches; layers {layers}", flush=True)

    int8 = _fresh_run(root, "int8", prepared, args.samples, args.max_length)
    time_body(model, batches[:2])  # warm-up
    runs: dict[str, list[Clock]] = {"body": [], "eyas": [], "ohs": [], "naive": []}
    in_forward = []
    for r in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        runs["body"].append(time_body(model, batches))
        clock, share, _ = time_dump(int8, model, tokenizer)
        runs["eyas"].append(clock)
        in_forward.append(share)
        runs["ohs"].append(time_dump(int8, model, tokenizer, use_output_hidden_states=True)[0])
        runs["naive"].append(time_naive(model, batches, layers, root / "naive"))
        print(f"bench_dump: repeat {r + 1}: " + ", ".join(f"{k} {v[-1].wall:.2f}s wall {v[-1].cpu:.2f}s cpu"
                                                          for k, v in runs.items()) + f", in forward {share:.3f}",
              flush=True)

    def paired(a: str, b: str, clock: str = "cpu") -> float:
        """Median over repeats of the ratio a/b within each repeat (adjacent runs share the load)."""
        return statistics.median(getattr(x, clock) / getattr(y, clock) for x, y in zip(runs[a], runs[b]))

    med_wall = {k: statistics.median(c.wall for c in v) for k, v in runs.items()}
    naive_bytes = sum(p.stat().st_size for p in (root / "naive").iterdir())

    encodings = {
        "bf16": ["dump.encoding=bf16"],
        "fp8": ["dump.encoding=fp8"],
        "int8": [],
        "int8+int4_low+topk32": ["dump.low_layer_encoding=int4", "dump.teacher=topk", "dump.topk=32"],
        "int4_all": ["dump.encoding=int4"],
    }
    sizes = {}
    anchor = 4 * model.config.hidden_size * 2
    for name, extra in encodings.items():
        recipe = int8 if name == "int8" else _fresh_run(root, name.replace("+", "_"), prepared, args.samples, args.max_length, *extra)
        if name != "int8":
            time_dump(recipe, model, tokenizer)
        m = json.loads((recipe.run_dir / "shards" / "manifest.json").read_text())
        sizes[name] = {"bytes_per_token": round(m["bytes_per_token"], 1), "ratio": round(m["bytes_per_token"] / anchor, 4),
                       "features": list(m["features"])}
    reference = root / "bf16" / "shards"
    for name in encodings:
        if name != "bf16":
            run = "int8" if name == "int8" else name.replace("+", "_")
            sizes[name]["rel_rms_error_vs_bf16"] = reconstruction_error(root / run / "shards", reference)

    first = first_batch_times(root, [1000, 10000, 100000], repeats=5)

    figures = {
        "dump_vs_body_forward": paired("body", "eyas"),
        "dump_vs_body_forward_wall": paired("body", "eyas", "wall"),
        "dump_time_in_forward": statistics.median(in_forward),
        "dump_vs_naive_dump": paired("naive", "eyas"),
        "hooks_vs_output_hidden_states": paired("ohs", "eyas"),
        "dump_tokens_per_s": tokens / med_wall["eyas"],
        "body_tokens_per_s": tokens / med_wall["body"],
        "bytes_per_token_ratio_int8": sizes["int8"]["ratio"],
        "bytes_per_token_ratio_fp8": sizes["fp8"]["ratio"],
        "bytes_per_token_ratio_compact": sizes["int8+int4_low+topk32"]["ratio"],
        "bytes_per_token_ratio_int4_all": sizes["int4_all"]["ratio"],
        "naive_bytes_per_token_ratio": naive_bytes / tokens / anchor,
        "time_to_first_batch_100k_s": first[100000],
        "time_to_first_batch_100k_vs_1k": first[100000] / first[1000],
    }
    units = {"dump_tokens_per_s": "tokens/s", "body_tokens_per_s": "tokens/s", "time_to_first_batch_100k_s": "s"}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "cpu_seconds": {k: [round(c.cpu, 3) for c in v] for k, v in runs.items()},
        "wall_seconds": {k: [round(c.wall, 3) for c in v] for k, v in runs.items()},
        "ratios_use": "median over repeats of per-repeat ratios of process CPU time (all threads), unless the name "
                      "ends in _wall; dump_time_in_forward = wall time inside the target forward / dump wall time; "
                      "tokens/s use wall time",
        "sizes": sizes, "time_to_first_batch_s": {str(k): round(v, 4) for k, v in first.items()},
        "settings": {"target": "smollm2-135m-instruct", "samples_read": args.samples, "samples": len(dataset),
                     "max_length": args.max_length,
                     "tokens": tokens, "batches": len(batches), "token_budget": base.dump.token_budget,
                     "shard_tokens": base.dump.shard_tokens, "layers": layers, "repeats": args.repeats,
                     "anchor_bytes_per_token": anchor, "dtype": str(next(model.parameters()).dtype)},
        "machine": machine(),
        "versions": versions("transformers", "safetensors"),
    }, indent=2) + "\n")
    for name, value in figures.items():
        print(f"BENCH {name} {value:.4g} {units.get(name, 'ratio')}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
