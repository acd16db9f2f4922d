"""GPU check: the one prepared script a lent GPU machine runs, rehearsed on the CPU.

Run: `bash benchmarks/gpu_check.sh` (what CI and a lent machine run), or
`python benchmarks/gpu_check.py [--smoke] [--gpus N] [--out DIR] [--budget-s S] [--only STEP ...]`.

Writes ONE JSON file, `<out>/gpu_check.json` (`--out`, else $OUT, else a fresh temporary folder; --smoke
ignores $OUT; never benchmarks/results/), rewritten after every step so a run cut short still leaves what it
measured, and the output of every command it launched under `<out>/gpu_check_logs/`. Per step:
status (passed; failed with the error's tail; skipped with the reason), wall seconds, figures.
Prints one line per step and `BENCH gpu_check_steps_passed|failed <n> count`; exits 1 when a
step failed (skipped is not a failure).

Steps, on a Llama-shaped target built in code (tests/fixtures.py) and a few dozen synthetic
conversations written here as JSONL (no chat-data package is needed):
1. wheel   build the wheel from the working tree, install it with `pip install --no-deps --target`,
           import eyas and its stages from there (the editable finder taken out); every later step
           runs eyas from that copy. Versions: python, torch, CUDA, GPU, bf16, the libraries.
2. rotary  `pytest -q tests/test_rotary.py`.
3. dump    prepare once; dump fp8 shards on CUDA in bf16 and on the CPU in fp32, decode both with
           ShardReader, relative error per token (median, max) against the fp32 dump.
           Without CUDA: CPU bf16 against CPU fp32, so the comparison runs.
4. train   `accelerate launch` with recipes/accelerate/{ddp,deepspeed_zero2,fsdp}.yaml: an
           uninterrupted 4-step run saving at step 2, and a second launch that resumes from
           that save and continues to step 4; its final weights against the uninterrupted run's.
           Without CUDA: ddp (bitwise) and ZeRO-2 with --cpu in fp32; FSDP skipped. --gpus N > 1
           adds N-process runs.
5. ttt     the 8B-shaped TTT attention (benchmarks/bench_long_context.py) at 2K and 8K tokens:
           peak memory and step time, beside `eyas plan`'s prediction. Without CUDA: a small T.
6. eval    `eyas eval` with the draft trained in step 4 (target bf16 on CUDA, fp32 on the CPU),
           chain:3 and a dynamic tree: τ, and whether every output equalled the target's greedy one.
7. plan    `eyas plan recipes/llama3.1-8b-eagle3.yaml --gpu h200-141gb --gpus 1`, its output kept.

`--smoke` (also what the benchmark smoke test runs): the CPU sizes and only the cheap steps
(dump, ttt, plan), well under a minute. Without CUDA every step runs at CPU sizes
(100-135 s on 2 loaded cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
STEPS = ("wheel", "rotary", "dump", "train", "ttt", "eval", "plan")
# The cheap ones (tests/test_benchmarks_smoke.py runs every script's --smoke); rotary is left out as CI
# runs tests/test_rotary.py in the suite anyway, and a pytest start-up is a quarter of a smoke run here.
SMOKE_STEPS = ("dump", "ttt", "plan")
# No network on a lent machine: nothing asks a hub, in this process (main sets them) or a launched one.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
# Distributions whose presence decides what can run (the lent machine promises torch and
# transformers only); reported at the start, each missing one named in the steps it skips.
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "safetensors", "deepspeed", "pyyaml", "tokenizers",
            "numpy", "pytest", "rich", "tqdm", "matplotlib", "filelock", "pip", "setuptools")
# What each step cannot run without (beyond eyas's own imports, which the wheel step checks).
NEEDS = {"wheel": ("pip", "setuptools"), "rotary": ("pytest", "pyyaml", "safetensors", "tokenizers"),
         "dump": ("datasets", "safetensors", "pyyaml", "tokenizers", "numpy"),
         "train": ("accelerate", "datasets", "safetensors", "pyyaml", "numpy"), "ttt": ("pyyaml",),
         "eval": ("datasets", "safetensors", "pyyaml", "rich", "tqdm", "matplotlib"), "plan": ("pyyaml",)}
# Synthetic conversations: enough tokens for the train step's 4 steps of 400 tokens (32 chats: 2,688
# training tokens); a smoke run dumps fewer, as a loaded CPU ran the bf16 dump at ~150 tokens/s here.
CHATS, CHATS_SMOKE = 32, 12
TRAIN_CONFIGS = ("ddp.yaml", "deepspeed_zero2.yaml", "fsdp.yaml")
TRAIN_STEPS, SAVE_AT = 4, 2
# Dump tolerance, relative error per token ||a - b|| / ||b|| of the decoded fp8 features, test dump
# against the fp32 CPU dump. Each dump rounds every element to fp8 e4m3 (3 mantissa bits: a step of
# 2^-3 relative, so up to 2^-4 relative per element from rounding alone), so two dumps of slightly
# different features differ by a whole fp8 step wherever the drift pushed an element across a
# rounding boundary. bf16 weights and activations add a drift of a few 2^-8 per layer. Measured on
# this target (CPU bf16 against CPU fp32, 2,688 tokens): median 0.020-0.025 per feature (growing with
# depth: fused layers 2, 4, 5, then the last hidden state), max 0.046; fp32 against fp32 is 0. The
# bounds leave 2x on the median and 3x on the max (the tail of a few thousand tokens moves most) for a
# GPU's other bf16 kernels (cuBLAS, flash/mem-efficient SDPA). A wrong layer, dtype or device path
# differs by order 1: features more than fp8 rounding of a bf16 forward apart fail.
DUMP_MEDIAN_TOL, DUMP_MAX_TOL = 0.05, 0.15
# Resume tolerance on a GPU (bf16 autocast): cuBLAS and the loss kernels may reduce in another order
# between two launches, so the two runs' continued steps differ by rounding, which AdamW then
# normalises. Measured as ||resumed - uninterrupted|| / ||uninterrupted(step 4) - step 2||: the
# difference against what the two continued steps changed. A broken resume (lost optimizer state,
# another data position, a re-initialised head) gives a ratio near or above 1; rounding, a few %.
# On the CPU in fp32 a DDP resume is bitwise equal (MKL_CBWR strict mode), as eyas's own resume tests
# require. A ZeRO-2 resume on the CPU is held to the ratio: on one CI machine its resumed weights
# differed by 2.9e-6 at most (rounding), where this machine's six runs were bitwise equal; cause not found.
RESUME_REL_TOL = 0.05
EVAL_SHAPES = ["chain:3", "dynamic:depth=4,topk=4,nodes=16"]
PLAN_RECIPE = REPO / "recipes" / "llama3.1-8b-eagle3.yaml"
# Llama-3.1-8B-Instruct's config.json (the fields eyas's planner and targets read), written in code:
# the lent machine has no network and no model weights.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


class Skip(Exception):
    """The step (or case) cannot run here; the message is the reason."""


class CheckFailed(Exception):
    """The step ran and a property it checks did not hold; the message says which, `figures` what it measured."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


@dataclass
class Context:
    out: Path                  # gpu_check.json and gpu_check_logs/ (what comes back from a lent machine)
    work: Path                 # scratch: target, data, runs
    cuda: bool
    gpus: int
    smoke: bool
    packages: dict[str, str | None]
    deadline: float            # time.monotonic() past which no step starts and launches are cut
    site: Path | None = None   # the installed wheel (step 1); None: eyas as this environment has it
    shared: dict = field(default_factory=dict)  # what a later step reads from an earlier one

    def missing(self, *names: str) -> list[str]:
        return [n for n in names if self.packages.get(n) is None]

    def seconds_left(self) -> float:
        """Of the time budget (--budget-s): what a step or a launched command may still take."""
        return self.deadline - time.monotonic()


# ----------------------------------------------------------------------------- bookkeeping


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution (None: absent). Metadata only: importing deepspeed compiles."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def below_floors(packages: dict[str, str | None]) -> dict[str, str]:
    """Each present distribution older than the floor pyproject.toml declares for it ("2.11.0 < 2.13"): what this
    machine runs that CI's floors run does not test (a GPU image's own torch, say)."""
    import tomllib

    from packaging.version import Version

    below = {}
    for requirement in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        match = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)", requirement)
        installed = packages.get(match[1]) if match else None
        if installed and Version(installed) < Version(match[2]):
            below[match[1]] = f"{installed} < {match[2]}"
    return below


def tail(text: str, chars: int = 2500) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def run_step(name: str, body: Callable[[Context], dict], ctx: Context) -> dict:
    """One step: its figures and status, never an exception. Missing packages and spent time skip it."""
    start = time.perf_counter()
    result: dict = {"status": "passed", "seconds": 0.0, "figures": {}}
    try:
        missing = ctx.missing(*NEEDS.get(name, ()))
        if missing:
            raise Skip(f"needs {', '.join(missing)} (not installed)")
        if ctx.seconds_left() < 5:
            raise Skip("the time budget (--budget-s) is spent")
        # What a step prints in this process (prepare's and dump's progress) goes to its log, not the summary.
        log_path = ctx.out / "gpu_check_logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(log_path, "a") as log, redirect_stdout(log), redirect_stderr(log):
                result["figures"] = body(ctx) or {}
        finally:
            if log_path.stat().st_size == 0:
                log_path.unlink()
    except Skip as why:
        result.update(status="skipped", reason=str(why))
    except CheckFailed as why:
        result.update(status="failed", error=tail(str(why)), figures=why.figures)
    # Any error is the step's result and the next steps still run; SystemExit too (a benchmark's helper
    # exits when its subprocess fails), KeyboardInterrupt not.
    except (Exception, SystemExit):  # noqa: BLE001
        result.update(status="failed", error=tail(traceback.format_exc()))
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def case_status(cases: dict[str, dict], figures: dict | None = None) -> None:
    """A step made of cases (train's launcher configs): failed if one failed, skipped if all were."""
    statuses = [c["status"] for c in cases.values()]
    if "failed" in statuses:
        raise CheckFailed("; ".join(f"{k}: {c['error']}" for k, c in cases.items() if c["status"] == "failed"), figures)
    if statuses and all(s == "skipped" for s in statuses):
        raise Skip("; ".join(f"{k}: {c['reason']}" for k, c in cases.items()))


def run_case(body: Callable[[], dict]) -> dict:
    """A case of a step, with the step's statuses (the step goes on to its next case after a failure)."""
    start = time.perf_counter()
    try:
        case = {"status": "passed", **body()}
    except Skip as why:
        case = {"status": "skipped", "reason": str(why)}
    except CheckFailed as why:
        case = {"status": "failed", "error": tail(str(why), 1500), **why.figures}
    except (Exception, SystemExit):  # noqa: BLE001
        case = {"status": "failed", "error": tail(traceback.format_exc(), 1500)}
    case["seconds"] = round(time.perf_counter() - start, 2)
    return case


def summary_line(name: str, result: dict) -> str:
    """`gpu_check dump: passed in 12.3 s (median_rel=0.031 ...)`: the step's status and its scalar figures."""
    line = f"gpu_check {name}: {result['status']} in {result['seconds']:.1f} s"
    if result["status"] == "skipped":
        return f"{line} ({result['reason']})"
    if result["status"] == "failed":
        return f"{line}: {(result['error'].strip().splitlines() or [''])[-1][:200]}"
    scalars = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result["figures"].items()
               if isinstance(v, int | float | str | bool) and len(str(v)) < 40]
    return line + (f" ({', '.join(scalars[:8])})" if scalars else "")


def write_report(ctx: Context, report: dict) -> Path:
    path = ctx.out / "gpu_check.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def count(report: dict, status: str) -> int:
    return sum(1 for r in report["steps"].values() if r["status"] == status)


# ----------------------------------------------------------------------------- launching


def child_env(**extra: str) -> dict:
    """The environment of every launched command: offline, quiet, reproducible (eyas's PYTHONPATH: `use_site`)."""
    # MKL_CBWR: MKL picks kernels by memory alignment unless told not to, which changes the last bits of
    # a matmul between two launches (the resume check compares bits on the CPU). CUBLAS_WORKSPACE_CONFIG:
    # cuBLAS's deterministic workspace, so the GPU resume differs by as little as the kernels allow.
    return dict(os.environ, **OFFLINE, MKL_CBWR="AUTO,STRICT", CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1",
                **extra)


def missing_module(text: str) -> str | None:
    """The third-party module a failed command could not import, if that is why it failed (not eyas's own)."""
    found = re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", text)
    top = found[-1].split(".")[0] if found else None
    return top if top and top != "eyas" else None


def launch(ctx: Context, label: str, cmd: list[str], timeout_s: float, env: dict | None = None,
           cwd: Path | None = None) -> str:
    """Run a command (its own process group, killed whole at the timeout), keep its output under
    gpu_check_logs/, return it; a missing third-party module skips, any other non-zero exit fails.

    cwd defaults to the scratch folder, never the repository root: there `python -m eyas...` would
    import the source folder `eyas/` (which lacks eyas.data, eyas.train: they map from data/, train/)
    instead of the installed wheel."""
    timeout_s = max(1.0, min(timeout_s, ctx.seconds_left()))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd or ctx.work, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # accelerate's workers too, not only the launcher
        output, _ = proc.communicate()
        _log(ctx, label, cmd, output, f"killed after {timeout_s:.0f} s")
        raise CheckFailed(f"{label}: no result within {timeout_s:.0f} s (killed); output tail:\n{tail(output, 1200)}") from None
    _log(ctx, label, cmd, output, f"exit {proc.returncode} after {time.perf_counter() - start:.1f} s")
    if proc.returncode != 0:
        module = missing_module(output)
        if module:
            raise Skip(f"needs the Python module {module} (not installed)")
        raise CheckFailed(f"{label} exited with status {proc.returncode}; output tail:\n{tail(output)}")
    return output


def _log(ctx: Context, label: str, cmd: list[str], output: str, outcome: str) -> None:
    folder = ctx.out / "gpu_check_logs"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{label}.log").write_text(f"$ {' '.join(cmd)}\n# {outcome}\n{output}")


def use_site(ctx: Context, site: Path) -> None:
    """eyas from `site` for the rest of the run: in this process, and in every child, also those a
    benchmark function starts itself (bench_long_context measures each case in a subprocess)."""
    ctx.site = site
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)


def source_site(dest: Path) -> Path:
    """The installed layout built from the source folders without pip (eyas.data from data/, ...), for the
    steps after a wheel step that could not install (no pip or setuptools, or a broken build)."""
    import tomllib

    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):  # eyas before eyas.data
        shutil.copytree(REPO / folder, dest / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def import_eyas(ctx: Context) -> None:
    """eyas in this process: the wheel's copy after step 1, else the environment's; a step without it skips."""
    if util.find_spec("eyas") is None:
        raise Skip("eyas is not importable: the wheel step did not install it and the environment has no eyas")


# ----------------------------------------------------------------------------- step 1: wheel

# Run in a fresh interpreter outside the work tree (as tests/test_install.py does): drops the editable
# finder, imports the modules from the installed copy, and reports versions and the accelerator.
_PROBE = r"""
import importlib, json, sys
from importlib import metadata
site = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, site)
modules = {}
for name in sys.argv[2:]:
    try:
        module = importlib.import_module(name)
        where = str(getattr(module, "__file__", ""))
        modules[name] = "ok" if where.startswith(site) else f"imported from outside the wheel: {where}"
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        modules[name] = f"needs {top} (not installed)" if top and top != "eyas" else f"error: {exc!r}"
    except Exception as exc:
        modules[name] = f"error: {exc!r}"
import torch
found = {"eyas": __import__("eyas").__version__, "python": sys.version.split()[0], "torch": torch.__version__,
         "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
for dist in ("transformers", "accelerate", "deepspeed", "datasets", "safetensors"):
    try:
        found[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        found[dist] = None
def ask(read):  # one unreadable property is recorded as its error, not the end of the probe
    try:
        return read()
    except Exception as exc:
        return f"error: {exc!r}"
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    nccl = ask(lambda: torch.cuda.nccl.version())
    found.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                 capability=".".join(map(str, torch.cuda.get_device_capability(0))), bf16=ask(torch.cuda.is_bf16_supported),
                 cudnn=ask(torch.backends.cudnn.version), nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
else:
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    found.update(gpu=None, bf16=[f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()])
print(json.dumps({"modules": modules, "versions": found}))
"""
WHEEL_MODULES = ("eyas", "eyas.draft", "eyas.data.dump", "eyas.train.loop", "eyas.eval.decoder", "eyas.serving.vllm_mtp")


def wheel_sources(dest: Path) -> Path:
    """What `pip wheel .` reads from the working tree (pyproject, README, LICENSE, the mapped source
    folders), copied to `dest`, so the build leaves no build/ or egg-info in the tree and a stale one
    there cannot fill in a package pyproject leaves out."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = sorted(set(config["tool"]["setuptools"]["package-dir"].values()))
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    for folder in folders:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def without_eyas(pythonpath: str) -> str:
    """PYTHONPATH less the folders that hold an eyas package (the checkout), so the probe imports the wheel's copy;
    the rest stays (a lent machine's carried wheels, --target'ed into a folder on it)."""
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and not (Path(p) / "eyas").exists())


def step_wheel(ctx: Context) -> dict:
    src = wheel_sources(ctx.work / "wheel-src")
    built, site = ctx.work / "wheel", ctx.work / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = child_env(PIP_NO_INDEX="1")  # no network on a lent machine: fail fast, never wait for an index
    launch(ctx, "wheel-build", [*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(built)], 240, env)
    (wheel,) = built.glob("eyas-*.whl")
    launch(ctx, "wheel-install", [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], 120, env)
    clean = child_env(PYTHONPATH=without_eyas(os.environ.get("PYTHONPATH", "")))
    probe = launch(ctx, "wheel-import", [sys.executable, "-c", _PROBE, str(site), *WHEEL_MODULES], 180, clean)
    found = json.loads(probe.strip().splitlines()[-1])
    broken = {m: s for m, s in found["modules"].items() if s != "ok" and not s.startswith("needs ")}
    if broken:
        raise CheckFailed(f"modules that do not import from the installed wheel: {broken}")
    if found["modules"]["eyas"] != "ok":
        raise CheckFailed(f"eyas itself does not import from the wheel: {found['modules']['eyas']}")
    use_site(ctx, site)
    return {"wheel": wheel.name, "wheel_kib": round(wheel.stat().st_size / 1024, 1), "modules": found["modules"],
            **found["versions"]}


# ----------------------------------------------------------------------------- step 2: rotary


def step_rotary(ctx: Context) -> dict:
    output = launch(ctx, "rotary", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    str(REPO / "tests" / "test_rotary.py")], 240)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", output)}
    if not counts.get("passed"):
        raise CheckFailed(f"pytest ran no passing test:\n{tail(output, 1200)}")
    return {"tests_passed": counts.get("passed", 0), "tests_skipped": counts.get("skipped", 0)}


# ----------------------------------------------------------------------------- step 3: dump

_USER = ["Can you tell me about {t}?", "What do you think of {t}?", "Explain {t} in simple words.",
         "Write two sentences on {t}.", "Why do people care about {t}?", "Give me a tip about {t}."]
_REPLY = ["Sure, {t} is a broad subject, and here is a short answer.", "Many people enjoy {t} on sunny days.",
          "The key idea of {t} fits in one line: start small and check each step.",
          "I would say {t} is worth a try; it takes practice, 10 or 20 minutes a day.",
          "Here is a summary: {t} has a long history and a bright future.",
          "def answer():\n    return '{t}'\n\nprint(answer())"]
_TOPICS = ["the weather", "a hawk learning to fly", "Python code", "speculative decoding", "music and movies",
           "the capital of France", "long walks in the park", "books", "the mountains", "numbers like 0123456789"]


def synthetic_chats(count: int = CHATS, seed: int = 0) -> list[dict]:
    """`count` OpenAI-format conversations of 1-3 exchanges from fixed phrases (deterministic in `seed`)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        messages = []
        for _ in range(rng.randint(1, 3)):
            topic = rng.choice(_TOPICS)
            messages.append({"role": "user", "content": rng.choice(_USER).format(t=topic)})
            reply = " ".join(rng.choice(_REPLY).format(t=topic) for _ in range(rng.randint(1, 3)))
            messages.append({"role": "assistant", "content": reply})
        rows.append({"id": f"synthetic-{i}", "messages": messages})
    return rows


def base_recipe(ctx: Context, target: Path, chats: Path) -> dict:
    """The check's recipe (written as JSON, which YAML reads): tiny data and shapes, eagle3, TTT 3."""
    return {
        "run": {"name": "base", "output_dir": str(ctx.work / "runs"), "seed": 0},
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "data": {"source": str(chats), "max_length": 96, "heldout_fraction": 0.15},
        "dump": {"draft_vocab_size": 128, "shard_tokens": 2000, "token_budget": 400, "encoding": "fp8"},
        "draft": {"kind": "eagle3"},
        "train": {"token_budget": 400, "max_steps": TRAIN_STEPS, "save_every": SAVE_AT, "keep_last": 4, "ttt_steps": 3,
                  "eval_every": 0, "eval_batches": 2, "log_every": 1, "warmup_steps": 1, "lr": 1e-3,
                  "mixed_precision": "fp32"},
        "eval": {"prompts": "heldout", "max_prompts": 4, "max_new_tokens": 24, "shapes": EVAL_SHAPES, "baseline": True},
    }


def workspace(ctx: Context) -> dict:
    """The tiny target, the synthetic chats, the recipe file and one prepare (run `base`), made once."""
    if "recipe" in ctx.shared:
        return ctx.shared
    from machine import tiny_target  # benchmarks/ is on sys.path (main)

    from eyas.config import load_recipe
    from eyas.data.prepare import prepare

    # The tiny target of steps 3, 4 and 6 on every machine (so the CPU-measured tolerances apply on the GPU):
    # the smoke runs' (benchmarks/machine.py), head_dim 64 and 8 layers, EAGLE-3's fused layers 2, 4, 5.
    target = tiny_target(ctx.work / "target")
    chats = ctx.work / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in synthetic_chats(CHATS_SMOKE if ctx.smoke else CHATS)))
    recipe = ctx.work / "recipe.yaml"
    recipe.write_text(json.dumps(base_recipe(ctx, target, chats), indent=1))
    prepare(load_recipe(recipe))
    ctx.shared.update(recipe=recipe, runs=ctx.work / "runs", target=target)
    return ctx.shared


def new_run(ctx: Context, name: str, source: str = "base", parts: tuple[str, ...] = ("prepared",)) -> Path:
    """A fresh run directory sharing `source`'s prepared data (and shards) through symlinks."""
    from machine import linked_run  # benchmarks/ is on sys.path (main)

    return linked_run(ctx.shared["runs"] / name, ctx.shared["runs"] / source, parts)


def dump_run(ctx: Context, name: str, device: str, dtype: str) -> Path:
    """Dump the prepared data in run `name` with the target on `device` in `dtype`; returns the shards."""
    from eyas.config import load_recipe
    from eyas.data.dump import dump

    new_run(ctx, name)
    dump(load_recipe(ctx.shared["recipe"], [f"run.name={name}", f"target.device={device}", f"target.dtype={dtype}"]))
    return ctx.shared["runs"] / name / "shards"


def token_errors(test_dir: Path, ref_dir: Path) -> dict[str, list[float]]:
    """Per token and stored feature (each fused layer apart, then last_hidden): ||a - b|| / ||b||, b the reference."""
    import torch

    from eyas.data.shard_reader import ShardReader

    test, ref = ShardReader(test_dir), ShardReader(ref_dir)
    rows = {test.prepared_index(i): i for i in range(len(test))}
    if sorted(rows) != sorted(ref.prepared_index(i) for i in range(len(ref))):
        raise CheckFailed("the two dumps hold different samples of the same prepared data")
    errors: dict[str, list[float]] = {}
    for j in range(len(ref)):
        a, b = test.sample(rows[ref.prepared_index(j)]), ref.sample(j)
        if not torch.equal(a["input_ids"], b["input_ids"]):
            raise CheckFailed(f"prepared row {ref.prepared_index(j)}: the dumps stored different token ids")
        for feature in ("aux_hidden", "last_hidden"):
            x, y = a[feature].double(), b[feature].double()
            width = y.shape[-1] // 3 if feature == "aux_hidden" else y.shape[-1]
            for k, (xs, ys) in enumerate(zip(x.split(width, -1), y.split(width, -1))):
                name = f"aux_hidden.{k}" if feature == "aux_hidden" else feature
                rel = (xs - ys).norm(dim=-1) / ys.norm(dim=-1).clamp_min(1e-12)
                errors.setdefault(name, []).extend(rel.tolist())
    return errors


def error_summary(errors: dict[str, list[float]]) -> dict:
    import statistics

    per = {name: {"median": statistics.median(v), "max": max(v), "tokens": len(v)} for name, v in errors.items()}
    return {"per_feature": per, "median_rel": max(p["median"] for p in per.values()),
            "max_rel": max(p["max"] for p in per.values())}


def step_dump(ctx: Context) -> dict:
    import_eyas(ctx)
    workspace(ctx)
    start = time.perf_counter()
    ref = dump_run(ctx, "dump-cpu-fp32", "cpu", "float32")
    seconds = {"cpu_fp32": round(time.perf_counter() - start, 2)}
    label = "cuda-bf16" if ctx.cuda else "cpu-bf16"
    start = time.perf_counter()
    test = dump_run(ctx, f"dump-{label}", "cuda" if ctx.cuda else "cpu", "bfloat16")
    seconds[label.replace("-", "_")] = round(time.perf_counter() - start, 2)
    # Training reads the shards the real pipeline would make here: bf16 on the GPU, fp32 on the CPU.
    ctx.shared["train_source"] = f"dump-{label}" if ctx.cuda else "dump-cpu-fp32"
    if ctx.cuda:
        import torch

        torch.cuda.empty_cache()  # the target's blocks, cached by this process, are free for the training launches
    summary = error_summary(token_errors(test, ref))
    figures = {"compared": f"{label} vs cpu-fp32 (fp8 shards)", **summary, "median_tol": DUMP_MEDIAN_TOL,
               "max_tol": DUMP_MAX_TOL, "dump_seconds": seconds}
    if summary["median_rel"] > DUMP_MEDIAN_TOL or summary["max_rel"] > DUMP_MAX_TOL:
        raise CheckFailed(f"{label} features differ from the fp32 dump beyond fp8 rounding plus bf16 drift: median "
                          f"{summary['median_rel']:.4f} (tol {DUMP_MEDIAN_TOL}), max {summary['max_rel']:.4f} "
                          f"(tol {DUMP_MAX_TOL})", figures)
    return figures


# ----------------------------------------------------------------------------- step 4: train


def train_args(ctx: Context, config: str, processes: int, run: str) -> list[str]:
    precision = "bf16" if ctx.cuda else "fp32"
    # `python -m accelerate.commands.launch`: the launcher of this interpreter, whatever `accelerate` PATH finds
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes" / "accelerate" / config),
            "--num_processes", str(processes), *([] if ctx.cuda else ["--cpu"]), "-m", "eyas.train",
            str(ctx.shared["recipe"]), f"run.name={run}", f"train.mixed_precision={precision}"]


def train_log(run: Path) -> list[dict]:
    lines = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def weights(run: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def weight_difference(resumed: dict, full: dict, before: dict) -> dict:
    """Max abs difference of the resumed run's final weights against the uninterrupted run's, and its norm
    against the norm of what the continued steps changed (uninterrupted final minus the shared save)."""
    import torch

    if resumed.keys() != full.keys():
        raise CheckFailed(f"the two runs saved different tensors: {sorted(resumed.keys() ^ full.keys())}")
    diff = sum(float((resumed[k].double() - full[k].double()).pow(2).sum()) for k in full) ** 0.5
    moved = sum(float((full[k].double() - before[k].double()).pow(2).sum()) for k in full) ** 0.5
    return {"max_abs_diff": max(float((resumed[k].double() - full[k].double()).abs().max()) for k in full),
            "bitwise_equal": all(torch.equal(resumed[k], full[k]) for k in full),
            "rel_to_update": diff / moved if moved else float("inf"), "update_norm": moved}


def resume_tolerance(ctx: Context, config: str) -> float | str:
    """"bitwise" for DDP on the CPU; elsewhere the largest difference allowed, relative to the continued update."""
    return "bitwise" if not ctx.cuda and config == "ddp.yaml" else RESUME_REL_TOL


def train_case(ctx: Context, config: str, processes: int) -> dict:
    """Uninterrupted run (saves at SAVE_AT and TRAIN_STEPS), then a second launch resuming from its SAVE_AT save.

    A bitwise case that differs is run once more in fresh folders, and that second pair decides: on some
    CPUs a fresh training launch is, rarely, not bitwise reproducible even without a resume (seen in CI,
    cause unknown: docs/reliability.md), while a real resume fault differs every time. The first
    attempt's figures stay in the report (`first_attempt`)."""
    if config == "fsdp.yaml" and not ctx.cuda:
        raise Skip("accelerate runs FSDP on GPUs only")
    if config.startswith("deepspeed") and ctx.missing("deepspeed"):
        raise Skip("needs deepspeed (not installed)")
    name = f"train-{config.removesuffix('.yaml')}-{processes}p"
    tolerance = resume_tolerance(ctx, config)
    figures, resumed = train_pair(ctx, config, processes, name)
    if tolerance == "bitwise" and not figures["bitwise_equal"]:
        print(f"# gpu_check train: {name}: resumed weights differ from the uninterrupted run's by "
              f"{figures['max_abs_diff']:.3g} at most; running the pair once more (a launch that was not "
              "reproducible, or a resume fault: the second pair tells)", flush=True)
        first = figures
        figures, resumed = train_pair(ctx, config, processes, f"{name}-again")
        figures["first_attempt"] = first
    if tolerance == "bitwise" and not figures["bitwise_equal"]:
        raise CheckFailed(f"{name}: resumed weights are not bitwise equal to the uninterrupted run's in fp32 on the CPU "
                          f"(max abs diff {figures['max_abs_diff']:.3g}{', twice running' if 'first_attempt' in figures else ''})",
                          figures)
    if tolerance != "bitwise" and figures["rel_to_update"] > tolerance:
        raise CheckFailed(f"{name}: resumed weights differ from the uninterrupted run by {figures['rel_to_update']:.3g} "
                          f"of the continued steps' update (tolerance {tolerance})", figures)
    ctx.shared.setdefault("checkpoint", resumed / "checkpoints" / f"step_{TRAIN_STEPS:08d}")
    return figures


def train_pair(ctx: Context, config: str, processes: int, name: str) -> tuple[dict, Path]:
    """The uninterrupted launch and the resumed one; their weight difference and losses, and the resumed run."""
    from eyas.train.metrics import first_loss_difference, logged_losses  # eyas from the site import_eyas chose

    source = ctx.shared["train_source"]
    full = new_run(ctx, f"{name}-full", source, ("prepared", "shards"))
    env = child_env(OMP_NUM_THREADS="1")
    launch(ctx, f"{name}-full", train_args(ctx, config, processes, full.name), 300, env)
    resumed = new_run(ctx, f"{name}-resumed", source, ("prepared", "shards"))
    saved = full / "checkpoints" / f"step_{SAVE_AT:08d}"
    shutil.copytree(saved, resumed / "checkpoints" / saved.name)
    output = launch(ctx, f"{name}-resumed", train_args(ctx, config, processes, resumed.name), 300, env)
    steps = [r["step"] for r in train_log(resumed)]
    said = f"resumed from {resumed / 'checkpoints' / saved.name} (step {SAVE_AT})" in output
    if not said or steps != list(range(SAVE_AT + 1, TRAIN_STEPS + 1)):
        raise CheckFailed(f"{name}: the second launch did not resume from step {SAVE_AT} (log says resumed: {said}; "
                          f"it trained steps {steps}, expected {SAVE_AT + 1}..{TRAIN_STEPS})")
    figures = weight_difference(weights(resumed, TRAIN_STEPS), weights(full, TRAIN_STEPS), weights(full, SAVE_AT))
    figures["losses"] = [round(r["loss"], 5) for r in train_log(full)]
    figures["resumed_losses"] = [round(r["loss"], 5) for r in train_log(resumed)]
    continued = {step: loss for step, loss in logged_losses(full).items() if step > SAVE_AT}  # the resumed run's steps
    figures["first_differing_loss_step"] = first_loss_difference(logged_losses(resumed), continued)
    return figures, resumed


def step_train(ctx: Context) -> dict:
    import_eyas(ctx)
    if "train_source" not in ctx.shared:
        raise Skip("needs the shards of the dump step, which did not pass")
    counts = [1] + ([ctx.gpus] if ctx.cuda and ctx.gpus > 1 else [])
    cases = {f"{c.removesuffix('.yaml')}-{n}p": run_case(lambda c=c, n=n: train_case(ctx, c, n))
             for n in counts for c in TRAIN_CONFIGS}
    figures = {"precision": "bf16" if ctx.cuda else "fp32", "steps": TRAIN_STEPS, "resumed_at": SAVE_AT,
               "resume_tolerance": {c.removesuffix(".yaml"): resume_tolerance(ctx, c) for c in TRAIN_CONFIGS}, "cases": cases}
    case_status(cases, figures)
    return figures


# ----------------------------------------------------------------------------- step 5: ttt

LONG_CONTEXT = REPO / "benchmarks" / "bench_long_context.py"
PLAN_GPU = "h200-141gb"


def plan_inputs(ctx: Context, overrides: list[str] = ()) -> tuple:
    """The 8B recipe, Llama-3.1-8B's config (written to the scratch folder) and the planned GPU, for eyas.cli.plan."""
    if util.find_spec("eyas.cli.plan") is None:
        raise Skip("eyas plan not found")
    from eyas.cli.plan import hardware, read_config
    from eyas.config import load_recipe

    path = ctx.work / "llama31-8b-config.json"
    path.write_text(json.dumps(LLAMA31_8B))
    recipe = load_recipe(PLAN_RECIPE, [f"run.output_dir={ctx.work / 'plan-runs'}", *overrides])
    return recipe, read_config(recipe, str(path)), hardware(PLAN_GPU, max(1, ctx.gpus), None), path


def plan_prediction(ctx: Context, tokens: int) -> dict:
    """`eyas plan`'s training need of the 8B eagle3 recipe at train.token_budget = data.max_length = `tokens` (GiB)."""
    from eyas.memory import shapes_of
    from eyas.train.memory import draft_size, train_need

    recipe, config, hw, _ = plan_inputs(ctx, [f"train.token_budget={tokens}", f"data.max_length={tokens}"])
    need = train_need(recipe, config, shapes_of(config), draft_size(recipe, config), hw, "ddp")
    gib = float(1 << 30)
    return {"plan_train_gib": need.device_total / gib, "plan_activations_gib": need.device["activations"] / gib,
            "plan_notes": need.notes}


def step_ttt(ctx: Context) -> dict:
    """bench_long_context's part A (the TTT attention of the 8B layer, 32/8 heads of 128, 7-step unroll, bf16 on a GPU,
    forward+backward; q/k/v as inputs, projections left out) at 2K and 8K tokens on the GPU, beside eyas plan."""
    import_eyas(ctx)
    if not LONG_CONTEXT.is_file():
        raise Skip("benchmarks/bench_long_context.py not found")
    import bench_long_context  # benchmarks/ is on sys.path (main)

    # On the GPU each case runs in a fresh process (its peak is its own; `smoke` False), 3 repeats, and the dense
    # reference only where its estimate fits (2K); on the CPU one small T in this process, so the code runs.
    seqs = [2048, 8192] if ctx.cuda else [128]
    # bf16 on the GPU: CUDA's flash kernel takes bf16/fp16 only (in fp32 the fused path falls back to the dense one)
    args = argparse.Namespace(seqs=seqs, heads=32, kv_heads=8, head_dim=128, steps=7, repeats=3 if ctx.cuda else 1,
                              budget_gb=60.0 if ctx.cuda else 1.0, smoke=not ctx.cuda, device="cuda" if ctx.cuda else "cpu",
                              dtype="bfloat16" if ctx.cuda else "float32",
                              case_timeout_s=max(30.0, ctx.seconds_left()))  # a hung case ends the step
    rows = bench_long_context.part_attention(args, print)
    gib = float(1 << 30)
    cases = {f"{r['path']}_{r['seq']}": {"measured": r["measured"], "seconds": r["seconds"],
                                          "peak_gib": r["peak_bytes"] / gib, "saved_gib": r["saved_bytes"] / gib}
             for r in rows}
    try:
        plan = {str(t): plan_prediction(ctx, t) for t in seqs}
    except Skip as why:
        plan = {"skipped": str(why)}
    figures = {"device": args.device, "peak_source": "torch.cuda.max_memory_allocated" if ctx.cuda else "RSS (in process)",
               "shape": f"32/8 heads x 128, 7 steps, {args.dtype}, batch 1", "cases": cases, "plan": plan,
               "scope": "measured: the TTT attention alone; plan: the whole 8B eagle3 train step at that token budget (bf16)"}
    if not all(case["measured"] for name, case in cases.items() if name.startswith("fused")):
        raise CheckFailed("a fused TTT attention case did not run", figures)
    return figures


# ----------------------------------------------------------------------------- step 6: eval


def step_eval(ctx: Context) -> dict:
    import_eyas(ctx)
    checkpoint = ctx.shared.get("checkpoint")
    if checkpoint is None:
        raise Skip("needs a checkpoint from the train step, which trained none")
    device, dtype = ("cuda", "bfloat16") if ctx.cuda else ("cpu", "float32")
    out = ctx.work / "eval"
    launch(ctx, "eval", [sys.executable, "-m", "eyas.cli", "eval", str(ctx.shared["recipe"]),
                         f"run.name={ctx.shared['train_source']}", f"eval.checkpoint={checkpoint}",
                         f"target.device={device}", f"target.dtype={dtype}", "--out", str(out)], 300)
    report = json.loads((out / "report.json").read_text())
    configs, matches = {}, []
    for config in report["configs"]:
        s = config["overall"]
        match = s.get("greedy_match") or {"matched": 0, "compared": 0}
        matches.append(match["compared"] > 0 and match["matched"] == match["compared"])
        configs[config["shape"]] = {"tau": s["tau"], "alpha": s["alpha"], "greedy_matched": match["matched"],
                                    "greedy_compared": match["compared"], "speedup": s.get("speedup")}
    figures = {"target_dtype": dtype, "prompts": report["settings"]["prompts_used"],
               "greedy_all_equal": all(matches), "shapes": configs}
    # fp32: speculative decoding must reproduce greedy decoding exactly. bf16 on a GPU: a verify pass over
    # several tokens and the one-token greedy pass may round a near-tie apart, so a mismatch is reported
    # (greedy_all_equal) without failing the step.
    if dtype == "float32" and not all(matches):
        raise CheckFailed("speculative outputs differ from the target's greedy outputs in fp32", figures)
    return figures


# ----------------------------------------------------------------------------- step 7: plan


def step_plan(ctx: Context) -> dict:
    import_eyas(ctx)
    _, _, _, config_path = plan_inputs(ctx)
    counts = sorted({1, ctx.gpus} - {0})
    outputs = {}
    for gpus in counts:
        output = launch(ctx, f"plan-{gpus}gpu", [sys.executable, "-m", "eyas.cli", "plan", str(PLAN_RECIPE), "--gpu", PLAN_GPU,
                                                 "--gpus", str(gpus), "--target-config", str(config_path)], 180)
        outputs[f"{gpus}gpu"] = output.strip().splitlines()
    return {"gpu": PLAN_GPU, "recipe": str(PLAN_RECIPE.relative_to(REPO)), "output": outputs,
            "fits": all(not any("DOES NOT FIT" in line for line in lines) for lines in outputs.values())}


# ----------------------------------------------------------------------------- main


BODIES: dict[str, Callable[[Context], dict]] = {"wheel": step_wheel, "rotary": step_rotary, "dump": step_dump,
                                                "train": step_train, "ttt": step_ttt, "eval": step_eval,
                                                "plan": step_plan}


def eyas_source(ctx: Context) -> str:
    """Where the later steps import eyas from: the wheel, the environment's install, or (neither there)
    a copy of the source folders in the installed layout, so one broken step does not cost the others."""
    if ctx.site is not None:
        return f"the installed wheel ({ctx.site})"
    if util.find_spec("eyas") is not None:
        return "the environment's install"
    use_site(ctx, source_site(ctx.work / "source-site"))
    return f"a copy of the source folders in the installed layout ({ctx.site}): the wheel step did not install"


def out_dir(arg: str | None, smoke: bool = False) -> Path:
    """--out, else $OUT (a lent machine's returned folder), else a fresh temporary folder; never benchmarks/results/.
    A smoke run ignores $OUT: its figures measure nothing and must not replace a real run's JSON there."""
    chosen = arg or (None if smoke else os.environ.get("OUT"))
    path = Path(chosen).resolve() if chosen else Path(tempfile.mkdtemp(prefix="eyas-gpu-check-"))
    if path == RESULTS or RESULTS in path.parents:
        raise SystemExit(f"gpu_check writes its JSON outside {RESULTS} (it holds the published figures); give another --out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU sizes and only the cheap steps: " + ", ".join(SMOKE_STEPS))
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to use (default: all visible; at most those); >1 adds N-process runs, 0 the CPU sizes")
    parser.add_argument("--out", help="folder for gpu_check.json (default $OUT, else a temporary folder)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="no step starts after this many seconds, and launches are cut at it (default 480)")
    parser.add_argument("--only", nargs="+", choices=STEPS, help="run only these steps (their inputs: dump before train, ...)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (target, shards, checkpoints)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(OFFLINE)  # before torch, transformers or datasets read them
    # Progress bars would fill the logs (stages' own, datasets', transformers' weight loading), here and in children.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    begin, start = datetime.datetime.now(datetime.UTC), time.perf_counter()
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # at most one rank per GPU (NCCL refuses two on one device); --gpus 0 runs the CPU sizes on a GPU machine
    gpus = visible if args.gpus is None else max(0, min(args.gpus, visible))
    cuda = gpus > 0 and not args.smoke
    ctx = Context(out=out_dir(args.out, args.smoke), work=Path(tempfile.mkdtemp(prefix="eyas-gpu-check-work-")), cuda=cuda,
                  gpus=gpus, smoke=args.smoke, packages=package_versions(), deadline=time.monotonic() + args.budget_s)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine  # benchmarks/machine.py

    missing = [name for name, version in ctx.packages.items() if version is None]
    report = {"script": "gpu_check", "started": begin.isoformat(timespec="seconds"), "argv": sys.argv[1:],
              "mode": "cuda" if cuda else "cpu", "smoke": args.smoke, "gpus": gpus, "visible_gpus": visible,
              "machine": machine(), "packages": ctx.packages, "missing_packages": missing,
              "below_floors": below_floors(ctx.packages), "steps": {}}
    host = report["machine"]
    print(f"# gpu_check: {'CUDA, ' + str(gpus) + ' GPU(s)' if cuda else 'CPU sizes'}"
          f"{' (--smoke: ' + ', '.join(SMOKE_STEPS) + ')' if args.smoke else ''}; host CPU {host['cpu_model']} "
          f"({host['cpus']} CPUs; {' '.join(host['isa']) or 'no AVX2'}); missing packages: "
          f"{', '.join(missing) or 'none'}; below pyproject's floors: "
          f"{', '.join(f'{k} {v}' for k, v in report['below_floors'].items()) or 'none'}; "
          f"writing {ctx.out / 'gpu_check.json'}", flush=True)
    try:
        for name in STEPS:
            if args.only and name not in args.only:
                result = {"status": "skipped", "seconds": 0.0, "figures": {}, "reason": "not in --only"}
            elif args.smoke and name not in SMOKE_STEPS:
                result = {"status": "skipped", "seconds": 0.0, "figures": {},
                          "reason": "--smoke runs only " + ", ".join(SMOKE_STEPS)}
            else:
                result = run_step(name, BODIES[name], ctx)
            report["steps"][name] = result
            if name == "wheel":
                report["eyas_from"] = eyas_source(ctx)
            report["seconds"] = round(time.perf_counter() - start, 1)
            write_report(ctx, report)
            print(summary_line(name, result), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(ctx.work, ignore_errors=True)
    report.update(passed=count(report, "passed"), failed=count(report, "failed"), skipped=count(report, "skipped"),
                  seconds=round(time.perf_counter() - start, 1))
    path = write_report(ctx, report)
    print(f"# gpu_check: {report['passed']} passed, {report['failed']} failed, {report['skipped']} skipped in "
          f"{report['seconds']:.0f} s; wrote {path}")
    print(f"BENCH gpu_check_steps_passed {report['passed']} count")
    print(f"BENCH gpu_check_steps_failed {report['failed']} count")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
