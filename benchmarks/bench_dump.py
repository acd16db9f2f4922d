"""Dump benchmark: throughput against the bare decoder stack, bytes per token, time to first batch,
host memory against the shard size.

Run: `python benchmarks/bench_dump.py` (about 5 minutes on 2 CPU cores, where SmolLM2 runs at a
few hundred tokens/s; `--samples`, `--max-length`, `--repeats`, `--memory-repeats` for a longer run;
`--smoke`: seconds on a tiny target, every figure printed, its JSON in a temp folder or --out).

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
4. Host memory per rank against the shard size: a whole `eyas dump` in a fresh process (one
   process = one rank) per run, peak RSS (ru_maxrss) and the high-water mark after the target is
   loaded, shards of 4,096 and 32,768 tokens (8x: 268 MB) on a one-layer target of hidden size 1024
   (8 KB of bf16 features per token, so shards get large for little compute), 2,048-token batches,
   interleaved, medians over --memory-repeats; side by side with the whole-shard writer the dump
   used before (every batch kept, concatenated at the end of the shard, serialised by
   `write_shard`). From the host memory measured per encoded batch, an estimate (not a
   measurement) for the Llama-3.1-8B recipe (recipes/llama3.1-8b-eagle3.yaml: fp8,
   32,768-token batches, 1,048,576-token shards).
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
from types import SimpleNamespace

import machine  # benchmarks/machine.py
import numpy as np
import torch

RESULTS = Path(__file__).parent / "results" / "bench_dump.json"
# The memory runs' target: one layer of hidden size 1024, so a token carries 8 KB of bf16 features
# for little compute and a shard of 32,768 tokens is 268 MB.
WIDE_TARGET = {"hidden_size": 1024, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8}
# Llama-3.1-8B-Instruct's shapes (its config.json), for the estimate at the 8B recipe's settings.
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256}
RECIPE_8B = machine.REPO / "recipes" / "llama3.1-8b-eagle3.yaml"


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
    from eyas.data.batches import budget_batches
    from eyas.data.dump import pad_right, plan_shards, sample_lengths

    lengths = sample_lengths(dataset)
    out = []
    for shard in plan_shards(lengths, dump_cfg.shard_tokens):
        rows = dataset[[int(i) for i in shard]]["input_ids"]
        for batch in budget_batches(np.arange(len(shard)), lengths[shard], dump_cfg.token_budget):
            out.append((pad_right([rows[i] for i in batch]), [len(rows[i]) for i in batch]))
    return out


def time_body(model, batches) -> machine.Clock:
    decoder = model.get_decoder()
    with machine.Clock() as clock, torch.inference_mode():
        for ids, _ in batches:
            decoder(input_ids=ids, use_cache=False)
    return clock


def time_naive(model, batches, layers: list[int], out_dir: Path) -> machine.Clock:
    """Full forward with all hidden states; each sample's tensors torch.save'd as they come."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    n = 0
    with machine.Clock() as clock, torch.inference_mode():
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


def time_dump(recipe, model, tokenizer, use_output_hidden_states: bool = False) -> tuple[machine.Clock, float, dict]:
    """A whole `eyas dump`; also returns the share of its wall time spent inside the target's forward."""
    from eyas.data import dump as dump_module

    shutil.rmtree(recipe.run_dir / "shards", ignore_errors=True)
    original = dump_module.HiddenCapture.__call__
    inside = [0.0]

    def via_ohs(self, input_ids, lengths=None):
        out = self.decoder(input_ids=input_ids, use_cache=False, output_hidden_states=True)
        return [out.hidden_states[i] for i in self.aux_layers], out.last_hidden_state

    forward = via_ohs if use_output_hidden_states else original

    def timed(self, input_ids, lengths=None):
        start = time.perf_counter()
        result = forward(self, input_ids, lengths)
        inside[0] += time.perf_counter() - start
        return result

    dump_module.HiddenCapture.__call__ = timed
    try:
        with machine.Clock() as clock:
            manifest = dump_module.dump(recipe, model=model, tokenizer=tokenizer)
        return clock, inside[0] / clock.wall, manifest
    finally:
        dump_module.HiddenCapture.__call__ = original


def reconstruction_error(shard_dir: Path, reference_dir: Path, limit: int = 40) -> dict:
    """Relative RMS error per feature block against the bf16 dump (same samples, same order)."""
    from eyas.data.shard_reader import ShardReader

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
    from eyas.data.dump import finalize_split, manifest_features
    from eyas.data.shard_format import SCHEMA_VERSION, encode
    from eyas.data.shard_reader import ShardReader
    from eyas.data.shard_writer import write_shard
    from eyas.train.loader import TokenBudgetLoader

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
                  "features": manifest_features({"aux_layers": [2, 3, 4], "aux_encodings": ["int8"] * 3,
                                                 "last_hidden": True, "last_encoding": "int8", "topk": 0}, hidden)}
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


class WholeShardWriter:
    """The dump's writer before it streamed, for the side-by-side memory figure: every batch kept
    until the shard's last, concatenated, then serialised by `write_shard` (on the finishing thread,
    while the next shard's batches pile up). Same interface as `ShardWriter`, same bytes on disk."""

    def __init__(self, directory: Path, index: int, lengths: np.ndarray, sample_index: np.ndarray, metadata: dict):
        self.where, self.lengths, self.sample_index = (directory, index, metadata), lengths, sample_index
        self.parts: dict[str, list[torch.Tensor]] = {}

    def write(self, rows: dict[str, torch.Tensor], samples: int) -> None:
        for name, t in rows.items():
            self.parts.setdefault(name, []).append(t)

    def finish(self) -> dict:
        from eyas.data.shard_writer import write_shard

        tensors = {name: torch.cat(parts) for name, parts in self.parts.items()}
        tensors["offsets"] = torch.from_numpy(np.concatenate([[0], np.cumsum(self.lengths)])).long()
        tensors["sample_index"] = torch.from_numpy(np.asarray(self.sample_index, dtype=np.int64))
        directory, index, metadata = self.where
        return write_shard(directory, index, tensors, metadata)

    def abort(self) -> None:
        self.parts = {}


def peak_rss_child(recipe_file: str, writer: str) -> None:
    """One dump in this fresh process; prints JSON (bytes): `baseline` its RSS once the target is
    loaded, `dump_peak` the RSS high-water mark of the dump alone (VmHWM, reset after loading, which
    can peak above what the dump holds), `peak` the process's (loading included; not ru_maxrss,
    which counts the parent's RSS at fork), and the largest shard and bytes per token."""
    from eyas.config import load_recipe
    from eyas.data import dump as dump_module
    from eyas.targets import load_target

    recipe = load_recipe(recipe_file)
    if writer == "whole":
        dump_module.ShardWriter = WholeShardWriter
    model, tokenizer = load_target(recipe.target)
    loading_peak = 1024 * machine.status_kib("VmHWM")
    machine.reset_peak()  # Linux: VmHWM restarts from the current RSS
    baseline = 1024 * machine.status_kib("VmRSS")
    manifest = dump_module.dump(recipe, model=model, tokenizer=tokenizer)
    dump_peak = 1024 * machine.status_kib("VmHWM")
    print(json.dumps({"peak": max(loading_peak, dump_peak), "baseline": baseline, "dump_peak": dump_peak,
                      "largest_shard": max(r["bytes"] for r in manifest["shards"]),
                      "bytes_per_token": manifest["bytes_per_token"]}))


def _memory_recipe(root: Path, target: Path, name: str, *extra: str):
    from eyas.config import load_recipe

    return load_recipe(None, [
        f"target.path={target}", f"data.source={root / 'memory-rows.jsonl'}", f"run.output_dir={root}", f"run.name={name}",
        "data.max_length=128", "data.overflow=truncate", "data.heldout_fraction=0.0", "dump.layers=[0, 1, 1]",
        "dump.encoding=bf16", "dump.draft_vocab_size=64", *extra,
    ])


def memory_runs(root: Path, sizes: tuple[int, int], repeats: int) -> dict:
    """Peak RSS of whole dumps in fresh processes, interleaved: both writers x both shard sizes with
    batches of half the smaller shard (so both sizes run the same batches), and the streaming writer
    at the larger size with batches 4x as large (the host memory a batch costs is the difference).

    The data: conversations of exactly 128 tokens, as many as the larger shard holds."""
    import random

    from eyas.data.prepare import prepare

    target = machine.tests_module("fixtures").build_tiny_target(root / "wide-target", "llama", **WIDE_TARGET)
    rng = random.Random(0)
    words = "the hawk flies over a mountain river while quick brown foxes sleep in sunny parks".split()
    rows = [{"messages": [{"role": "user", "content": "Tell me a story."},
                          {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(200))}]}
            for _ in range(sizes[1] // 128)]
    (root / "memory-rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    budget = sizes[0] // 2
    configs = [(writer, size, budget) for writer in ("stream", "whole") for size in sizes] + [("stream", sizes[1], 4 * budget)]
    prepared = _memory_recipe(root, target, "memory-prepared")
    prepare(prepared)
    runs: dict[str, list[dict]] = {}
    for r in range(repeats):
        for writer, size, token_budget in configs:
            key = f"{writer}-{size}-{token_budget}"
            recipe = _memory_recipe(root, target, f"memory-{key}", f"dump.shard_tokens={size}", f"dump.token_budget={token_budget}")
            shutil.rmtree(recipe.run_dir, ignore_errors=True)
            shutil.copytree(prepared.run_dir / "prepared", recipe.run_dir / "prepared")
            recipe_file = root / f"memory-{key}.yaml"
            recipe_file.write_text(json.dumps(recipe.to_dict()))
            runs.setdefault(key, []).append(machine.child_json(
                [sys.executable, __file__, "--peak-rss-child", str(recipe_file), writer],
                f"bench_dump: the {writer} dump with {size}-token shards failed", timeout=600))
            shutil.rmtree(recipe.run_dir)
            got = runs[key][-1]
            print(f"bench_dump: memory repeat {r + 1}: {writer} writer, {size}-token shards, {token_budget}-token batches: "
                  f"peak RSS of the dump {got['dump_peak'] / 1e6:.0f} MB (from {got['baseline'] / 1e6:.0f} MB once the "
                  f"target is loaded; process {got['peak'] / 1e6:.0f} MB)", flush=True)
    return {"runs": runs, "token_budget": budget, "sizes": list(sizes), "repeats": repeats}


def bytes_per_token_8b(recipe) -> int:
    """Bytes a token takes in the 8B recipe's shards: its features as `encode` stores them, id and mask."""
    from eyas.data.dump import feature_spec
    from eyas.data.shard_format import encode, ids_dtype

    spec = feature_spec(recipe, SimpleNamespace(num_hidden_layers=LLAMA_8B["num_hidden_layers"]))
    x = torch.zeros(1, LLAMA_8B["hidden_size"])
    encodings = spec["aux_encodings"] + ([spec["last_encoding"]] if spec["last_hidden"] else [])
    features = sum(t.numel() * t.element_size() for encoding in encodings for t in encode(x, encoding).values())
    id_bytes = torch.empty(0, dtype=ids_dtype(LLAMA_8B["vocab_size"])).element_size()
    return features + spec["topk"] * (2 + id_bytes) + id_bytes + 1


def memory_figures(memory: dict) -> dict:
    """Peak RSS ratios and sizes, the host memory per byte of an encoded batch (the slope between the
    two batch sizes) and the dump's fixed part, and from them the estimates at the 8B recipe's settings."""
    from eyas.config import load_recipe

    (small, large), budget = memory["sizes"], memory["token_budget"]
    med = lambda key, field: statistics.median(run[field] for run in memory["runs"][key])  # noqa: E731
    growth = lambda key: statistics.median(run["dump_peak"] - run["baseline"] for run in memory["runs"][key])  # noqa: E731
    stream_s, stream_l, stream_big = f"stream-{small}-{budget}", f"stream-{large}-{budget}", f"stream-{large}-{4 * budget}"
    whole_s, whole_l = f"whole-{small}-{budget}", f"whole-{large}-{budget}"
    per_token = med(stream_l, "bytes_per_token")
    per_batch_byte = (growth(stream_big) - growth(stream_l)) / (3 * budget * per_token)
    fixed = growth(stream_l) - per_batch_byte * budget * per_token
    shard_copies = (growth(whole_l) - growth(stream_l)) / med(stream_l, "largest_shard")
    recipe = load_recipe(RECIPE_8B)
    per_token_8b = bytes_per_token_8b(recipe)
    batch_8b, shard_8b = recipe.dump.token_budget * per_token_8b, recipe.dump.shard_tokens * per_token_8b
    dump_8b = fixed + per_batch_byte * batch_8b
    return {
        "dump_peak_rss_ratio_large_vs_small_shard": med(stream_l, "dump_peak") / med(stream_s, "dump_peak"),
        "whole_shard_writer_peak_rss_ratio_large_vs_small_shard": med(whole_l, "dump_peak") / med(whole_s, "dump_peak"),
        "process_peak_rss_ratio_large_vs_small_shard": med(stream_l, "peak") / med(stream_s, "peak"),
        "dump_peak_rss_small_shard_mb": med(stream_s, "dump_peak") / 1e6,
        "dump_peak_rss_large_shard_mb": med(stream_l, "dump_peak") / 1e6,
        "whole_shard_writer_peak_rss_large_shard_mb": med(whole_l, "dump_peak") / 1e6,
        "dump_host_bytes_per_batch_byte": per_batch_byte,
        "dump_host_fixed_mb": fixed / 1e6,
        "whole_shard_writer_extra_shard_copies": shard_copies,
        "estimate_8b_dump_host_gb_per_rank": dump_8b / 1e9,
        "estimate_8b_whole_shard_writer_host_gb_per_rank": (dump_8b + shard_copies * shard_8b) / 1e9,
        "estimate_8b_bytes_per_token": per_token_8b,
        "estimate_8b_batch_gb": batch_8b / 1e9,
        "estimate_8b_shard_gb": shard_8b / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60, help="chitchat conversations read (about half have an answer)")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per sample (longer ones are truncated)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-repeats", type=int, default=3, help="repeats of each peak-RSS run (fresh processes)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    machine.add_report_args(parser, "bench_dump.json", "seconds: tiny targets and shapes, one repeat; figures measure nothing")
    parser.add_argument("--peak-rss-child", nargs=2, metavar=("RECIPE", "WRITER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.peak_rss_child:
        peak_rss_child(*args.peak_rss_child)
        return 0

    from eyas.data.dump import feature_spec
    from eyas.data.prepare import load_prepared, prepare
    from eyas.recipe_schema import TargetConfig
    from eyas.targets import load_target

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-dump-"))
    target, memory_sizes, first_batch_counts = "smollm2-135m-instruct", (4096, 32768), [1000, 10000, 100000]
    if args.smoke:
        machine.apply_smoke(args, "bench_dump", target=False, samples=16, repeats=1, memory_repeats=1)
        target = str(machine.tiny_target(root / "target"))
        memory_sizes, first_batch_counts = (512, 4096), [100, 1000]
    on_target = [f"target.path={target}"]
    model, tokenizer = load_target(TargetConfig(path=target))
    base = _recipe(root, "base", args.samples, args.max_length, *on_target)
    prepare(base, tokenizer=tokenizer)
    prepared = base.run_dir / "prepared"
    dataset = load_prepared(base.run_dir, "train")
    tokens = sum(len(x) for x in dataset["input_ids"])
    if not tokens:
        raise SystemExit(f"bench_dump: no sample of the first {args.samples} chitchat conversations fits "
                         f"--max-length {args.max_length}; raise --samples or --max-length")
    batches = _batches(dataset, base.dump)
    layers = feature_spec(base, model.config)["aux_layers"]
    print(f"bench_dump: {len(dataset)} samples, {tokens} tokens, {len(batches)} batches; layers {layers}", flush=True)

    # int8 named explicitly: the recipe's default encoding is fp8
    int8 = _fresh_run(root, "int8", prepared, args.samples, args.max_length, *on_target, "dump.encoding=int8")
    time_body(model, batches[:2])  # warm-up
    runs: dict[str, list[machine.Clock]] = {"body": [], "eyas": [], "ohs": [], "naive": []}
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

    med_wall = machine.medians(runs)
    naive_bytes = sum(p.stat().st_size for p in (root / "naive").iterdir())

    encodings = {
        "bf16": ["dump.encoding=bf16"],
        "fp8": ["dump.encoding=fp8"],
        "int8": [],
        "int8+int4_low+topk32": ["dump.encoding=int8", "dump.low_layer_encoding=int4", "dump.teacher=topk", "dump.topk=32"],
        "int4_all": ["dump.encoding=int4"],
    }
    sizes = {}
    anchor = 4 * model.config.hidden_size * 2
    for name, extra in encodings.items():
        recipe = int8 if name == "int8" else _fresh_run(root, name.replace("+", "_"), prepared, args.samples, args.max_length,
                                                        *on_target, *extra)
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

    first = first_batch_times(root, first_batch_counts, repeats=1 if args.smoke else 5)
    largest, smallest = max(first_batch_counts), min(first_batch_counts)
    memory = memory_runs(root, memory_sizes, args.memory_repeats)
    memory_figs = memory_figures(memory)

    figures = {  # the ratios: median over repeats of a/b within each repeat (adjacent runs share the load)
        "dump_vs_body_forward": machine.paired(runs["body"], runs["eyas"]),
        "dump_vs_body_forward_wall": machine.paired(runs["body"], runs["eyas"], "wall"),
        "dump_time_in_forward": statistics.median(in_forward),
        "dump_vs_naive_dump": machine.paired(runs["naive"], runs["eyas"]),
        "hooks_vs_output_hidden_states": machine.paired(runs["ohs"], runs["eyas"]),
        "dump_tokens_per_s": tokens / med_wall["eyas"],
        "body_tokens_per_s": tokens / med_wall["body"],
        "bytes_per_token_ratio_int8": sizes["int8"]["ratio"],
        "bytes_per_token_ratio_fp8": sizes["fp8"]["ratio"],
        "bytes_per_token_ratio_compact": sizes["int8+int4_low+topk32"]["ratio"],
        "bytes_per_token_ratio_int4_all": sizes["int4_all"]["ratio"],
        "naive_bytes_per_token_ratio": naive_bytes / tokens / anchor,
        "time_to_first_batch_100k_s": first[largest],
        "time_to_first_batch_100k_vs_1k": first[largest] / first[smallest],
        **{k: v for k, v in memory_figs.items() if k not in ("estimate_8b_bytes_per_token", "estimate_8b_batch_gb",
                                                             "estimate_8b_shard_gb")},  # those three: in the JSON
    }
    units = {"dump_tokens_per_s": "tokens/s", "body_tokens_per_s": "tokens/s", "time_to_first_batch_100k_s": "s",
             "dump_peak_rss_small_shard_mb": "MB", "dump_peak_rss_large_shard_mb": "MB",
             "whole_shard_writer_peak_rss_large_shard_mb": "MB", "dump_host_fixed_mb": "MB",
             "whole_shard_writer_extra_shard_copies": "shards", "estimate_8b_dump_host_gb_per_rank": "GB",
             "estimate_8b_whole_shard_writer_host_gb_per_rank": "GB"}
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    machine.publish(machine.output_path(args.out, RESULTS, args.smoke), {
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "cpu_seconds": {k: [round(c.cpu, 3) for c in v] for k, v in runs.items()},
        "wall_seconds": {k: [round(c.wall, 3) for c in v] for k, v in runs.items()},
        "ratios_use": "median over repeats of per-repeat ratios of process CPU time (all threads), unless the name "
                      "ends in _wall; dump_time_in_forward = wall time inside the target forward / dump wall time; "
                      "tokens/s use wall time",
        "sizes": sizes, "time_to_first_batch_s": {str(k): round(v, 4) for k, v in first.items()},
        "memory": {**memory, "figures": {k: round(v, 4) for k, v in memory_figs.items()},
                   "target": WIDE_TARGET | {"encoding": "bf16", "fused_layers": [0, 1, 1], "sample_tokens": 128},
                   "peak": "a fresh process (one rank) running one whole dump, default allocator: dump_peak = VmHWM "
                           "reset once the target is loaded (the ratios and MB figures), baseline = VmRSS then, "
                           "peak = VmHWM of the whole process (loading included)",
                   "estimate_8b": f"an estimate, not a measurement: dump_host_fixed_mb + dump_host_bytes_per_batch_byte "
                                  f"(the measured slope of the dump's peak over its baseline between two batch sizes) "
                                  f"x one encoded batch at {RECIPE_8B.name}'s settings (Llama-3.1-8B: {LLAMA_8B}); the "
                                  "whole-shard writer adds its measured extra shard copies x one 8B shard. The slope "
                                  "is measured on a CPU, where the forward's activations are host memory too; on a GPU "
                                  "they live on the device, so the estimate over-counts. The process baseline "
                                  "(libraries, the CUDA context, the loaded target) is not included"},
        "settings": {"target": target, "smoke": args.smoke, "samples_read": args.samples, "samples": len(dataset),
                     "max_length": args.max_length,
                     "tokens": tokens, "batches": len(batches), "token_budget": base.dump.token_budget,
                     "shard_tokens": base.dump.shard_tokens, "layers": layers, "repeats": args.repeats,
                     "anchor_bytes_per_token": anchor, "dtype": str(next(model.parameters()).dtype)},
        **machine.environment("transformers", "safetensors"),
    }, machine.figure_lines(figures, units), "bench_dump")
    return 0


if __name__ == "__main__":
    sys.exit(main())
