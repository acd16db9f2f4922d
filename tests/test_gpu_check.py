"""benchmarks/gpu_check.py's bookkeeping: statuses, skips, the exit code, the JSON and BENCH lines.

The steps themselves run in `bash benchmarks/gpu_check.sh` (CI) and, cut to the cheap ones, in the
benchmark smoke test; these tests stub the step bodies and check what the driver makes of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402  (benchmarks/gpu_check.py)


@pytest.fixture
def ctx(tmp_path) -> gpu_check.Context:
    return gpu_check.Context(out=tmp_path / "out", work=tmp_path / "work", cuda=False, gpus=0, smoke=False,
                             packages={name: "1.0" for name in gpu_check.PACKAGES}, deadline=time.monotonic() + 600)


def _raise(exc: Exception):
    def body(*_):
        raise exc
    return body


def test_run_step_statuses(ctx):
    passed = gpu_check.run_step("ttt", lambda c: {"x": 1.5}, ctx)
    assert passed["status"] == "passed" and passed["figures"] == {"x": 1.5} and passed["seconds"] >= 0
    skipped = gpu_check.run_step("ttt", _raise(gpu_check.Skip("no GPU")), ctx)
    assert skipped["status"] == "skipped" and skipped["reason"] == "no GPU"
    failed = gpu_check.run_step("ttt", _raise(gpu_check.CheckFailed("max_rel 0.9 > 0.15")), ctx)
    assert failed["status"] == "failed" and failed["error"] == "max_rel 0.9 > 0.15"
    crashed = gpu_check.run_step("ttt", _raise(ZeroDivisionError("division by zero")), ctx)
    assert crashed["status"] == "failed" and "ZeroDivisionError: division by zero" in crashed["error"]
    assert "Traceback" in crashed["error"]  # the error's tail, not only its message


def test_missing_package_and_spent_budget_skip_without_running(ctx):
    ran = []
    ctx.packages["deepspeed"] = ctx.packages["accelerate"] = None
    result = gpu_check.run_step("train", lambda c: ran.append(1), ctx)
    assert result["status"] == "skipped" and result["reason"] == "needs accelerate (not installed)"
    ctx.deadline = time.monotonic()
    result = gpu_check.run_step("ttt", lambda c: ran.append(1), ctx)
    assert result["status"] == "skipped" and "budget" in result["reason"]
    assert ran == []


def test_step_output_goes_to_its_log(ctx, capsys):
    gpu_check.run_step("dump", lambda c: print("progress of the dump") or {}, ctx)
    assert "progress of the dump" not in capsys.readouterr().out
    assert "progress of the dump" in (ctx.out / "gpu_check_logs" / "dump.log").read_text()


def test_cases_decide_the_step():
    ok = {"status": "passed"}
    skip = {"status": "skipped", "reason": "accelerate runs FSDP on GPUs only"}
    bad = {"status": "failed", "error": "not bitwise equal"}
    gpu_check.case_status({"ddp": ok, "fsdp": skip})  # some passed, some skipped: the step passes
    with pytest.raises(gpu_check.CheckFailed, match="zero2: not bitwise equal"):
        gpu_check.case_status({"ddp": ok, "zero2": bad, "fsdp": skip})
    with pytest.raises(gpu_check.Skip, match="fsdp: accelerate runs FSDP"):
        gpu_check.case_status({"fsdp": skip})
    case = gpu_check.run_case(_raise(gpu_check.Skip("needs deepspeed")))
    assert case["status"] == "skipped" and case["reason"] == "needs deepspeed"


def test_launch_skips_on_a_missing_third_party_module_and_fails_otherwise(ctx):
    ctx.work.mkdir()
    output = gpu_check.launch(ctx, "hello", [sys.executable, "-c", "print('hello')"], 60)
    assert output.strip() == "hello" and "hello" in (ctx.out / "gpu_check_logs" / "hello.log").read_text()
    with pytest.raises(gpu_check.Skip, match="no_such_package_xyz"):
        gpu_check.launch(ctx, "missing", [sys.executable, "-c", "import no_such_package_xyz.sub"], 60)
    with pytest.raises(gpu_check.CheckFailed, match="status 3"):
        gpu_check.launch(ctx, "exit3", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 60)
    with pytest.raises(gpu_check.CheckFailed, match="killed"):
        gpu_check.launch(ctx, "slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1)


def test_missing_module_names_third_party_modules_only():
    assert gpu_check.missing_module("...\nModuleNotFoundError: No module named 'deepspeed.ops'\n") == "deepspeed"
    assert gpu_check.missing_module("ModuleNotFoundError: No module named 'eyas.data'") is None
    assert gpu_check.missing_module("RuntimeError: CUDA error") is None


def test_weight_difference_is_zero_only_for_equal_weights():
    before = {"w": torch.zeros(4, 4)}
    full = {"w": torch.ones(4, 4)}
    same = gpu_check.weight_difference({"w": torch.ones(4, 4)}, full, before)
    assert same["bitwise_equal"] and same["max_abs_diff"] == 0.0 and same["rel_to_update"] == 0.0
    off = {"w": torch.ones(4, 4)}
    off["w"][0, 0] += 0.4
    diff = gpu_check.weight_difference(off, full, before)
    assert not diff["bitwise_equal"] and diff["max_abs_diff"] == pytest.approx(0.4)
    assert diff["rel_to_update"] == pytest.approx(0.4 / 4.0)  # against ||full - before|| = 4


def test_resume_is_bitwise_for_ddp_on_the_cpu_and_a_ratio_elsewhere(ctx):
    assert gpu_check.resume_tolerance(ctx, "ddp.yaml") == "bitwise"
    assert gpu_check.resume_tolerance(ctx, "deepspeed_zero2.yaml") == gpu_check.RESUME_REL_TOL
    ctx.cuda = True
    assert gpu_check.resume_tolerance(ctx, "ddp.yaml") == gpu_check.RESUME_REL_TOL


@pytest.mark.parametrize("pairs, status", [([False, True], "passed"), ([False, False], "failed"), ([True], "passed")])
def test_a_bitwise_case_that_differs_runs_its_pair_once_more_and_the_second_decides(ctx, monkeypatch, pairs, status):
    """A rare fresh launch that is not bitwise reproducible must not fail the check; a resume fault
    (every pair differs) still does, and the first attempt's figures stay in the report."""
    ran = []

    def pair(_ctx, _config, _processes, name):
        ran.append(name)
        return {"bitwise_equal": pairs[len(ran) - 1], "max_abs_diff": 0.0 if pairs[len(ran) - 1] else 3.7e-6}, ctx.work

    monkeypatch.setattr(gpu_check, "train_pair", pair)
    case = gpu_check.run_case(lambda: gpu_check.train_case(ctx, "ddp.yaml", 1))
    assert case["status"] == status and ran == ["train-ddp-1p", "train-ddp-1p-again"][:len(pairs)]
    if len(pairs) == 2:
        assert case["first_attempt"]["max_abs_diff"] == 3.7e-6
    if status == "failed":
        assert "twice running" in case["error"]


def test_synthetic_chats_are_deterministic_conversations():
    rows = gpu_check.synthetic_chats(12, seed=3)
    assert rows == gpu_check.synthetic_chats(12, seed=3) and rows != gpu_check.synthetic_chats(12, seed=4)
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[0] == "user" and roles[-1] == "assistant" and roles[::2] == ["user"] * (len(roles) // 2)


def test_out_dir_refuses_the_published_results(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="outside"):
        gpu_check.out_dir(str(gpu_check.RESULTS / "x"))
    monkeypatch.setenv("OUT", str(tmp_path / "lent"))
    assert gpu_check.out_dir(None) == (tmp_path / "lent").resolve()
    assert gpu_check.out_dir(str(tmp_path / "mine")) == (tmp_path / "mine").resolve()
    assert gpu_check.out_dir(None, smoke=True) != (tmp_path / "lent").resolve()  # a smoke run never replaces $OUT's JSON


def _stub_bodies(monkeypatch, failing: str | None) -> list[str]:
    ran = []

    def body(name):
        def run(ctx):
            ran.append(name)
            if name == failing:
                raise gpu_check.CheckFailed(f"{name} broke")
            if name == "ttt":
                raise gpu_check.Skip("no GPU")
            return {"value": 1.0}
        return run

    monkeypatch.setattr(gpu_check, "BODIES", {name: body(name) for name in gpu_check.STEPS})
    return ran


def test_main_writes_one_json_prints_bench_lines_and_exits_1_on_a_failure(tmp_path, monkeypatch, capsys):
    ran = _stub_bodies(monkeypatch, failing="eval")
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert ran == list(gpu_check.STEPS)  # a failed step does not stop the later ones
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {k: r["status"] for k, r in report["steps"].items()} == {
        "wheel": "passed", "rotary": "passed", "dump": "passed", "train": "passed", "ttt": "skipped",
        "eval": "failed", "plan": "passed"}
    assert (report["passed"], report["failed"], report["skipped"]) == (5, 1, 1)
    assert report["steps"]["eval"]["error"] == "eval broke" and report["mode"] == "cpu"
    out = capsys.readouterr().out
    assert "BENCH gpu_check_steps_passed 5 count" in out and "BENCH gpu_check_steps_failed 1 count" in out
    assert "gpu_check eval: failed" in out and "gpu_check ttt: skipped" in out


def test_main_exits_0_when_nothing_failed_and_smoke_runs_only_the_cheap_steps(tmp_path, monkeypatch, capsys):
    ran = _stub_bodies(monkeypatch, failing=None)
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert ran == [s for s in gpu_check.STEPS if s in gpu_check.SMOKE_STEPS]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["steps"]["train"]["status"] == "skipped" and "--smoke" in report["steps"]["train"]["reason"]
    assert "BENCH gpu_check_steps_failed 0 count" in capsys.readouterr().out


def test_source_site_imports_the_stages_without_pip(tmp_path):
    """The fallback when the wheel step cannot install: the source folders in the installed layout import
    as the wheel does (eyas.data from data/, ...), from outside the work tree."""
    import subprocess

    site = gpu_check.source_site(tmp_path / "site")
    done = subprocess.run([sys.executable, "-c", gpu_check._PROBE, str(site), *gpu_check.WHEEL_MODULES], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])["modules"]
    assert modules == {name: "ok" for name in gpu_check.WHEEL_MODULES}


# ----------------------------------------------------------------------------- the lent machine's command

STUB_CHECK = """#!/usr/bin/env bash
# a stand-in for gpu_check.sh: what the command gives it (interpreter, carried wheel, settings, arguments)
mkdir -p "$2/gpu_check_logs"
for i in $(seq 15); do echo "log $i" > "$2/gpu_check_logs/step$i.log"; done
"$PYTHON" -c 'import carried, json, os, sys; print(json.dumps({"carried": carried.VALUE, "argv": sys.argv[1:],
  "env": {k: os.environ.get(k) for k in ("PYTHON", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
                                           "WANDB_MODE", "TOKENIZERS_PARALLELISM")}}))' "$@" > "$2/gpu_check.json"
echo "stub gpu_check ran"
"""


def lent_machine_command() -> str:
    """The fenced block after the marker in docs/stages.md ("The command a lent machine runs")."""
    text = (gpu_check.REPO / "docs" / "stages.md").read_text()
    after = text.split("<!-- the lent machine's command: tests/test_gpu_check.py reads the block below -->", 1)[1]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0]


def _wheel(folder: Path) -> Path:
    """A one-module wheel (`carried`), as the carried .whl/ files are installed."""
    path = folder / "carried-1.0-py3-none-any.whl"
    files = {"carried.py": "VALUE = 'from the carried wheel'\n",
             "carried-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: carried\nVersion: 1.0\n",
             "carried-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for name, body in files.items():
            zf.writestr(name, body)
        zf.writestr("carried-1.0.dist-info/RECORD", "".join(f"{name},,\n" for name in [*files, "carried-1.0.dist-info/RECORD"]))
    return path


def test_the_lent_machine_command_installs_the_carried_wheels_and_brings_back_three_files(tmp_path):
    """The documented command, run as the device tool runs it (repository root, $OUT empty) over a stand-in
    gpu_check.sh: under the tool's 2,000 characters, valid bash; the carried wheel imports in python3 from a
    fresh folder, every offline setting reaches the check, and $OUT holds three files (the logs in one tar)."""
    command = lent_machine_command()
    assert len(command) < 2000, f"the command is {len(command)} characters; the device tool takes 2,000"
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
    root, out, bin_dir = tmp_path / "checkout", tmp_path / "out", tmp_path / "bin"
    for folder in (root / ".whl", root / "benchmarks", out, bin_dir):
        folder.mkdir(parents=True)
    _wheel(root / ".whl")
    (root / "benchmarks" / "gpu_check.sh").write_text(STUB_CHECK)
    # The lent machine's interpreter is `python3`: here a script that runs this one by its own path (a link to a
    # venv's interpreter from outside the venv would not find the venv's packages, which sit beside pyvenv.cfg).
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE") and k != "PYTHONPATH"}
    env.update(OUT=str(out), PATH=f"{bin_dir}:{env['PATH']}", TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["console.txt", "gpu_check.json", "gpu_check_logs.tgz"]
    console = (out / "console.txt").read_text()
    assert console.startswith("pyarrow ") and "fsspec " in console.splitlines()[0] and "stub gpu_check ran" in console
    seen = json.loads((out / "gpu_check.json").read_text())
    assert seen["carried"] == "from the carried wheel" and seen["argv"][:2] == ["--out", str(out / "check")]
    assert seen["env"] == {"PYTHON": "python3", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
                           **{k: "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}}
    with tarfile.open(out / "gpu_check_logs.tgz") as tar:
        assert len([m for m in tar.getmembers() if m.name.endswith(".log")]) == 15
