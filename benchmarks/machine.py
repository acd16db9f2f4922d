"""What the benchmark and study scripts share, in one place (each imports it: `from machine import ...` or `import machine`):

- the machine: what a results JSON records a run ran on (CPU model and vector extensions, load, torch threads;
  timings here are ratios taken on a shared machine) and the versions of the libraries measured; the memory
  allocators a CPU loop can be preloaded with; this process's resident memory and its peak;
- the peers: the comparison trainers installed apart from eyas's environment (speculators, SpecForge), each
  with `pip install --no-deps --target` into its own folder and put on sys.path from there;
- run and time: a wall and CPU clock, paired medians over interleaved repeats, a measuring child process whose
  last line is its JSON, an `eyas` stage run with its output in a log, a run folder on another run's data;
- reports: where a results JSON goes (benchmarks/results/, or a temp folder under --smoke), the --out and
  --smoke options, the run's record (script, command, date, machine, versions), the JSON and the `BENCH` lines;
- the decoding benchmarks' options (target, prompts, shapes, threads), the target load and the prompts as ids;
- --smoke: the tiny target and run a smoke run measures instead of SmolLM2, built in code through tests/fixtures.py
  as the test suite builds its own, so a smoke run takes seconds and runs the script's real code path end to end;
- synthetic shards: random features in the layout `eyas dump` writes, for the loader and verification benchmarks.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------- the machine


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


def environment(*packages: str) -> dict:
    """A results JSON's `machine` and `versions` (of torch and `packages`), as every script records them."""
    return {"machine": machine(), "versions": versions(*packages)}


def set_threads(threads: int) -> None:
    """torch's CPU threads (0 or less: torch's default, as eyas runs)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB (VmRSS: now, VmHWM: its high-water mark)."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def reset_peak() -> None:
    """Start VmHWM over from the current resident size (Linux: `5` to /proc/self/clear_refs; OSError elsewhere)."""
    Path("/proc/self/clear_refs").write_text("5")


# ----------------------------------------------------------------------------- the peers


@dataclass(frozen=True)
class Peer:
    """A comparison trainer installed apart from eyas's environment, without its (GPU) dependencies."""

    packages: tuple[str, ...]  # pinned, as pip installs them
    site: str                  # the default folder (pip --target)
    marker: str                # a path under the folder that shows it installed


SPECULATORS = Peer(("speculators==0.9.0", "hs-connectors==0.9.0"), "/tmp/peers/speculators", "speculators")
SPECFORGE = Peer(("specforge==0.2.0",), "/tmp/peers/specforge", "specforge/core/loss.py")


def peer_installed(peer: Peer, site: str | Path) -> bool:
    return (Path(site) / peer.marker).exists()


def use_peer(peer: Peer, site: str | Path, who: str, install: bool = True) -> bool:
    """`peer` from `site` (first on sys.path), installed there with `pip install --no-deps --target` when missing
    and `install`; False (nothing imported from it) when it is missing and not to be installed."""
    if not peer_installed(peer, site):
        if not install:
            return False
        print(f"{who}: installing {' '.join(peer.packages)} into {site}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), *peer.packages],
                       check=True)
    sys.path.insert(0, str(site))
    return True


# ----------------------------------------------------------------------------- run and time


class Clock:
    """Wall time and this process's CPU time (all threads) of a block: on a shared machine the CPU time of
    a pass varies far less than its wall time, which other users' jobs stretch."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def timed(clock, fn, *args):
    """(fn(*args), seconds on `clock`)."""
    start = clock()
    out = fn(*args)
    return out, clock() - start


def paired(numerators: list, denominators: list, clock: str = "cpu") -> float:
    """Median over repeats of the ratio of two interleaved variants' `clock` seconds within each repeat
    (adjacent runs share the machine's load)."""
    return statistics.median(getattr(x, clock) / getattr(y, clock) for x, y in zip(numerators, denominators))


def medians(runs: dict[str, list], clock: str = "wall") -> dict[str, float]:
    """Each variant's median `clock` seconds over its repeats."""
    return {k: statistics.median(getattr(c, clock) for c in v) for k, v in runs.items()}


def child_json(cmd: list[str], failed: str, env: dict | None = None, timeout: float | None = None, tail: int = 3000,
               with_stdout: bool = False) -> dict | list:
    """A measuring child process (a fresh interpreter: its memory and threads its own), its last stdout line
    read as JSON. A non-zero exit stops this run: SystemExit with `failed` and the tail of the child's stderr
    (stdout and stderr with `with_stdout`). subprocess.TimeoutExpired past `timeout`."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{failed}:\n{((done.stdout if with_stdout else '') + done.stderr)[-tail:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_logged(cmd: list[str], log: Path, mode: str = "a", env: dict | None = None, cwd: str | Path | None = None
               ) -> tuple[int, float]:
    """Run `cmd` with its stdout and stderr in `log` (appended, or rewritten with mode "w"): (exit status, wall seconds)."""
    started = time.perf_counter()
    with open(log, mode) as handle:
        done = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return done.returncode, time.perf_counter() - started


def eyas_stage(stage: str, recipe: Path, overrides: list[str], log: Path, who: str) -> float:
    """One `eyas <stage>` on `recipe` in a child process, its output appended to `log`; its wall seconds
    (exits naming the log on failure). OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads do not spin."""
    print(f"{who}: eyas {stage} {' '.join(overrides)}  (log: {log})", flush=True)
    code, seconds = run_logged([sys.executable, "-m", "eyas.cli", stage, str(recipe), *overrides], log,
                               env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if code:
        sys.exit(f"{who}: `eyas {stage}` failed (exit {code}); see {log}")
    return seconds


def linked_run(run: Path, source: Path, parts: tuple[str, ...] = ("prepared", "shards"), fresh: bool = True) -> Path:
    """A run folder whose `parts` are links to `source`'s (the data another run prepared and dumped): emptied
    first when `fresh` (links are removed, not followed), else the links already there are kept."""
    if fresh:
        shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if not (run / part).exists():
            (run / part).symlink_to((source / part).resolve(), target_is_directory=True)
    return run


# ----------------------------------------------------------------------------- reports


def stamp() -> str:
    """Now, UTC, as the results JSONs date a run."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def command_line(script: str, argv: list[str] | None = None) -> str:
    """How the run was started: `python benchmarks/<script> ARGS` (`argv`, else this process's arguments)."""
    return " ".join(["python", f"benchmarks/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)])


def run_record(script: str, argv: list[str] | None = None) -> dict:
    """The head of a results JSON: which script, its command line, when."""
    return {"script": f"benchmarks/{Path(script).name}", "command": command_line(script, argv), "created": stamp()}


def add_report_args(parser, results: str, smoke: str) -> None:
    """--out and --smoke, as every benchmark has them: `results` names the JSON written under benchmarks/results/
    by default, `smoke` what a smoke run cuts the run to."""
    parser.add_argument("--out", help=f"results JSON (default benchmarks/results/{results}; --smoke: a temp folder)")
    parser.add_argument("--smoke", action="store_true", help=smoke)


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


def write_json(path: Path, record: dict, indent: int = 2, newline: bool = True, default=None) -> Path:
    """`record` as JSON at `path` (its folder made), as each script has always written its own (`indent`,
    a closing newline or not)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent, default=default) + ("\n" if newline else ""))
    return path


def bench_lines(*lines: str) -> None:
    """The `BENCH <name> <value> <unit> ...` lines a run ends with (what CI and the smoke test read)."""
    for line in lines:
        print(f"BENCH {line}", flush=True)


def publish(path: Path, record: dict, lines: list[str], who: str, indent: int = 2, newline: bool = True) -> Path:
    """A run's end: its results JSON written (`write_json`), its `BENCH` lines printed, then where it wrote."""
    write_json(path, record, indent, newline)
    bench_lines(*lines)
    print(f"{who}: wrote {path}", flush=True)
    return path


def slug(text: str) -> str:
    """A label (a tree shape, a draft) as a part of a `BENCH` name: runs of other characters as `_`."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def figure_lines(figures: dict[str, float], units: dict[str, str], default: str = "ratio") -> list[str]:
    """A `BENCH` line per figure, to 4 significant digits, in its unit (else `default`)."""
    return [f"{name} {value:.4g} {units.get(name, default)}" for name, value in figures.items()]


# ----------------------------------------------------------------------------- the decoding benchmarks


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

    from eyas.precision import native_bf16
    from eyas.recipe_schema import TargetConfig
    from eyas.targets import load_target

    set_threads(args.threads)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if native_bf16(torch.device("cpu")) else "float32")
    return (*load_target(TargetConfig(path=args.target, dtype=dtype)), dtype)


def encoded_prompts(args, tokenizer) -> list[list[int]]:
    """The prompts as token ids, first turns only: a later turn would need the target's own answer first."""
    from eyas.eval.prompts import load_prompts, render

    prompts, _ = load_prompts(args.prompts, Path(args.run) if args.run else None, args.max_prompts)
    return [render(p, tokenizer) for p in prompts]


# ----------------------------------------------------------------------------- --smoke


def smoke_dir(name: str) -> Path:
    """A fresh temporary folder for one smoke run (under $TMPDIR, which the smoke test points at its own)."""
    return Path(tempfile.mkdtemp(prefix=f"eyas-smoke-{name}-"))


def smoke_note(script: str) -> None:
    print(f"# {script} --smoke: tiny target and shapes, one repeat; the figures test the plumbing, they measure nothing",
          flush=True)


def apply_smoke(args, name: str, target: bool = True, **smaller) -> Path | None:
    """--smoke's start, as the scripts share it: the note, `smaller` set on `args` (the smoke run's sizes) and,
    with `target`, the tiny target in a fresh smoke folder as `args.target`; returns that folder (None without
    --smoke, or without `target`)."""
    if not args.smoke:
        return None
    smoke_note(name)
    vars(args).update(smaller)
    if not target:
        return None
    folder = smoke_dir(name)
    args.target = str(tiny_target(folder / "target"))
    return folder


def tests_module(name: str):
    """A helper module of tests/ (fixtures.py, train_helpers.py, fuzz_inputs.py), with tests/ on sys.path for
    the import only."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "tests"))


def tiny_target(folder: Path) -> Path:
    """A tiny Llama target with a real tokenizer and chat template, saved to `folder` (tests/fixtures.py)."""
    if (folder / "config.json").is_file():
        return folder
    return tests_module("fixtures").build_tiny_target(folder, "llama", **TINY_TARGET)


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


# ----------------------------------------------------------------------------- synthetic shards


def write_synthetic_dump(directory: Path, lengths, hidden: int, vocab: int, shard_tokens: int, layers: list[int],
                         plan: str, dtype=None, seed: int = 0) -> dict:
    """fp8 eagle3 shards (three fused layers + the last hidden state) of random features drawn in `dtype`
    (fp32 by default), samples of `lengths` tokens, laid out as `eyas dump` writes them; returns the manifest."""
    import numpy as np
    import torch

    from eyas.data.dump import finalize_split, plan_shards
    from eyas.data.shard_format import SCHEMA_VERSION, encode, ids_dtype
    from eyas.data.shard_writer import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(lengths, shard_tokens)
    for k, ids in enumerate(shards):
        tokens = int(lengths[ids].sum())
        g = torch.Generator().manual_seed(seed + k)
        tensors = {
            "input_ids": torch.randint(0, vocab, (tokens,), generator=g, dtype=torch.int32).to(ids_dtype(vocab)),
            "loss_mask": torch.ones(tokens, dtype=torch.uint8),
            "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[ids])])).long(),
            "sample_index": torch.from_numpy(ids.astype(np.int64)),
        }
        for name in ("aux_hidden.0", "aux_hidden.1", "aux_hidden.2", "last_hidden"):
            for suffix, t in encode(torch.randn(tokens, hidden, generator=g, dtype=dtype or torch.float32), "fp8").items():
                tensors[name + suffix] = t
        write_shard(directory, k, tensors, {"schema_version": SCHEMA_VERSION, "plan": plan, "shard": k})
    header = {"schema_version": SCHEMA_VERSION, "target_identity": "synthetic", "identity_scheme": 2,
              "target_path": "none", "hidden_size": hidden, "layers": layers, "encoding": "fp8",
              "features": {"aux_hidden": {"layers": layers, "encodings": ["fp8"] * 3, "shape": [3 * hidden]},
                           "last_hidden": {"encoding": "fp8", "shape": [hidden]}}}
    return finalize_split(directory, len(shards), header, wait=False, plan=plan)
