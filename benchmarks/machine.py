"""What a benchmark ran on, recorded in every results JSON: the machine (with its load, since
timings here are ratios taken on a shared machine) and the versions of the libraries measured.

Also what the decoding benchmarks share (their target, prompt and thread options, the target load,
the prompts as token ids) and what every script's `--smoke` shares: where a smoke run writes (never benchmarks/results/,
which holds the published figures) and the tiny target and run it measures instead of SmolLM2,
built in code through tests/fixtures.py as the test suite builds its own, so a smoke run takes
seconds and runs the script's real code path end to end.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BROAD_PROMPTS = REPO / "benchmarks" / "prompts" / "broad.jsonl"
# The tiny target of every smoke run: head_dim 64 (vLLM's CPU attention takes no smaller head) and
# 8 layers, so EAGLE-3's default fused layers (2, 4, 5) are three distinct ones.
TINY_TARGET = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
               "num_hidden_layers": 8}
# The quickstart recipe cut to seconds: a few dozen chitchat exchanges with their human replies
# (no regeneration), short samples, a 128-token draft vocabulary, a fifth held out for eval prompts.
SMOKE_RUN = ["data.max_samples=48", "data.max_length=96", "data.regenerate=false", "data.heldout_fraction=0.2",
             "dump.draft_vocab_size=128", "dump.token_budget=512", "dump.shard_tokens=2048", "train.token_budget=256",
             "train.epochs=1", "train.warmup_steps=1", "train.eval_batches=1", "train.log_every=1",
             "eval.max_prompts=2", "eval.max_new_tokens=8"]


# malloc replacements a CPU generation loop can be preloaded with (Debian: libtcmalloc-minimal4, libjemalloc2)
ALLOCATORS = {"tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
              "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}


def machine() -> dict:
    import torch

    info = cpu_info()
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "cpu_model": info["model"], "isa": info["isa"],
            "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
            "bf16_matmul": [f for f in ("avx512_bf16", "amx_bf16") if f in info["isa"]]}


def cpu_info() -> dict:
    """The CPU's model name and which of the vector extensions that pick MKL's and ATen's kernels it has
    (machines here differ: AVX2 only, AVX-512, AVX-512 with BF16 and AMX)."""
    model, flags = "", []
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return {"model": model or platform.processor(), "isa": isa}


def versions(*packages: str) -> dict:
    """Python and the given distributions (absent ones as None)."""
    found = {"python": sys.version.split()[0]}
    for name in ("torch", *packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def add_decode_args(parser, *, dtype: str, shapes: list[str], max_prompts: int, max_new_tokens: int) -> None:
    """The options of a script that decodes with the target: which target and weights, which tree
    shapes, which prompts (first turns), how many tokens, how many CPU threads."""
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "auto"],
                        help="the target's weights (auto: bf16 where this machine runs it natively, as eval does)")
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--prompts", default=str(BROAD_PROMPTS), help="JSONL prompts, or heldout (with --run)")
    parser.add_argument("--run", help="run directory whose held-out split --prompts heldout reads")
    parser.add_argument("--max-prompts", type=int, default=max_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default, as eval runs)")


def load_decode_target(args) -> tuple:
    """(target, tokenizer, dtype) for `add_decode_args`' options, `--dtype auto` resolved as eval resolves it;
    `--threads` applied first."""
    import torch

    from eyas.config import TargetConfig
    from eyas.precision import native_bf16
    from eyas.targets import load_target

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if native_bf16(torch.device("cpu")) else "float32")
    return (*load_target(TargetConfig(path=args.target, dtype=dtype)), dtype)


def encoded_prompts(args, tokenizer) -> list[list[int]]:
    """The prompts as token ids, first turns only: a later turn would need the target's own answer first."""
    from eyas.eval.prompts import load_prompts, render

    prompts, _ = load_prompts(args.prompts, Path(args.run) if args.run else None, args.max_prompts)
    return [render(p, tokenizer) for p in prompts]


def output_path(out: str | None, default: Path, smoke: bool, folder: Path | None = None) -> Path:
    """The file a run writes: `--out` when given, else `default` (benchmarks/results/...) for a real
    run, and for `--smoke` the run's own temporary `folder` (or a fresh one). A smoke run refuses
    benchmarks/results/: its tiny-shape figures must never replace a published one."""
    if out:
        path = Path(out).resolve()
        if smoke and RESULTS in (path, *path.parents):
            raise SystemExit(f"--smoke writes outside {RESULTS} (it holds the published figures); give another --out")
        return path
    if smoke:
        return (folder or smoke_dir(default.stem)) / default.name
    return default


def smoke_dir(name: str) -> Path:
    """A fresh temporary folder for one smoke run (under $TMPDIR, which the smoke test points at its own)."""
    return Path(tempfile.mkdtemp(prefix=f"eyas-smoke-{name}-"))


def smoke_note(script: str) -> None:
    print(f"# {script} --smoke: tiny target and shapes, one repeat; the figures test the plumbing, they measure nothing",
          flush=True)


def tiny_target(folder: Path) -> Path:
    """A tiny Llama target with a real tokenizer and chat template, saved to `folder` (tests/fixtures.py)."""
    if (folder / "config.json").is_file():
        return folder
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from fixtures import build_tiny_target
    finally:
        sys.path.remove(str(REPO / "tests"))
    return build_tiny_target(folder, "llama", **TINY_TARGET)


def tiny_run(root: Path, overrides: list[str] | tuple[str, ...] = (), name: str = "quickstart") -> Path:
    """A quickstart run prepared and dumped on the tiny target (recipe.yaml, prepared/, shards/), as
    `eyas quickstart` leaves one before training: what the studies and bench_peer_speculators read."""
    from eyas.cli.quickstart import packaged_recipe
    from eyas.config import load_recipe, save_resolved
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare

    target = tiny_target(root / "target")
    recipe = load_recipe(packaged_recipe(), [f"target.path={target}", f"run.output_dir={root}", f"run.name={name}",
                                             *SMOKE_RUN, *overrides])
    prepare(recipe)
    dump(recipe)
    save_resolved(recipe, recipe.run_dir)
    return recipe.run_dir
