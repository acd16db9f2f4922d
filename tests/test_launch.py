"""`eyas launch`: SIGTERM or SIGINT to a real 2-process `torchrun` or `accelerate launch` of eyas.train
ends with exit 0, one line, a whole checkpoint, and the same command resumes from it (slow); a
worker that fails on the signal keeps the launcher's failure (slow, no training); the torchrun
option eyas relies on, and the signal hand-over, checked without launching (fast)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from train_helpers import make_workspace, new_run, pause_training_at

from eyas.cli import launch
from eyas.train.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
TOTAL_STEPS = 20
PAUSE_AT = 3  # the signalled run waits after this step until its signal arrives


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PET_SIGNALS_TO_HANDLE", None)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launcher(name: str) -> list[str]:
    """The launcher's own command line, as a user types it after `eyas launch`."""
    port = str(_free_port())
    if name == "torchrun":
        return ["torchrun", "--nproc_per_node", "2", "--master_port", port]
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", port]  # DDP, gloo on a CPU


def _eyas_launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "eyas.cli", "launch", *args]


def _signal_once(proc: subprocess.Popen, ready, signum: int, timeout: float = 240) -> tuple[str, int]:
    """Send `signum` to the launcher once `ready()` holds; returns (stdout + stderr, exit status)."""
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the launch ended before the signal: " + proc.communicate()[0][-3000:]
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=240)
    return out, proc.returncode


# ----------------------------------------------------------------------------- eyas.train, stopped


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama_dir):
    ws = make_workspace(tmp_path_factory.mktemp("launch"), tiny_llama_dir)
    recipe = {
        "target": {"path": str(tiny_llama_dir)},
        "run": {"output_dir": str(ws["root"])},
        "dump": {"draft_vocab_size": 128},
        "train": {"token_budget": 400, "max_steps": TOTAL_STEPS, "ttt_steps": 3, "save_every": 0, "eval_every": 0,
                  "log_every": 1, "warmup_steps": 1, "lr": 1e-3, "mixed_precision": "fp32"},
    }
    ws["recipe"] = ws["root"] / "recipe.yaml"
    ws["recipe"].write_text(yaml.safe_dump(recipe))
    return ws


def _steps(run: Path) -> list[int]:
    rows = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    return [row["step"] for row in map(json.loads, rows) if row["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("launcher, signame", [("torchrun", "SIGTERM"), ("accelerate", "SIGINT")])
def test_signal_to_the_launcher_checkpoints_exits_zero_and_resumes(workspace, launcher, signame):
    name, signum = f"{launcher}_{signame}", getattr(signal, signame)
    run = new_run(workspace, name)
    command = _eyas_launch(*_launcher(launcher), "-m", "eyas.train", str(workspace["recipe"]), f"run.name={name}")
    pause = workspace["root"] / f"pause-{name}"
    proc = subprocess.Popen(command, cwd=REPO, env=pause_training_at(PAUSE_AT, pause, _env()), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # a rank waiting at PAUSE_AT: the run cannot end before the signal, nor pass that step
    out, status = _signal_once(proc, lambda: any(pause.glob("rank*")), signum)

    assert status == 0, out[-5000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-5000:]
    stop_lines = [line for line in out.splitlines() if line.startswith("eyas launch:")]
    assert stop_lines == [f"eyas launch: stopped by {signum.name}: the 2 workers saved their state and exited 0; "
                          "run the same command again to resume"], out[-3000:]
    saved = list_checkpoints(run / "checkpoints")  # complete ones only: each is published whole
    assert len(saved) == 1 and not list((run / "checkpoints").glob("*.partial")), out[-3000:]
    step = json.loads((saved[0] / "trainer.json").read_text())["step"]
    assert saved[0].name == f"step_{step:08d}" and step == PAUSE_AT < TOTAL_STEPS
    assert (saved[0] / "model.safetensors").is_file() and (saved[0] / "state").is_dir()
    assert f"SIGTERM at step {step}: saved" in out  # the workers got SIGTERM, whichever signal the launcher got
    assert _steps(run) == list(range(1, step + 1))

    again = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"(step {step})" in again.stdout + again.stderr  # "resumed from .../step_N (step N)"
    assert _steps(run) == list(range(1, TOTAL_STEPS + 1))  # each step once, continuing from the checkpoint


# ----------------------------------------------------------------------------- workers that fail on the signal

WORKER = """
import os, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(os.environ["EXIT_ON_SIGTERM"])))
pathlib.Path(sys.argv[1], os.environ["LOCAL_RANK"]).write_text(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("worker_exit", [3, 143])
def test_workers_that_do_not_exit_zero_keep_a_non_zero_status(tmp_path, worker_exit):
    """3: a failure keeps torchrun's own report and status; 143: eyas's stop before a save, one line, 128 + 15."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    proc = subprocess.Popen(_eyas_launch(*_launcher("torchrun"), str(script), str(ready)), cwd=tmp_path,
                            env={**_env(), "EXIT_ON_SIGTERM": str(worker_exit)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, status = _signal_once(proc, lambda: len(list(ready.iterdir())) == 2, signal.SIGTERM, timeout=120)
    if worker_exit == 3:
        assert status == 1 and "ChildFailedError" in out and "exitcode  : 3" in out, out[-3000:]
        assert "eyas launch:" not in out
    else:
        assert status == 143, out[-3000:]
        assert [line for line in out.splitlines() if line.startswith("eyas launch:")] == [
            "eyas launch: stopped by SIGTERM; the workers exited 143, stopped before a save (while starting, or a "
            "stage that keeps its finished files), run the same command again to continue"], out[-3000:]
        assert "Traceback" not in out


# ----------------------------------------------------------------------------- without launching


def test_torchrun_leaves_sigterm_and_sigint_to_eyas(monkeypatch):
    """eyas relies on torchrun reading its --signals-to-handle default from PET_SIGNALS_TO_HANDLE."""
    from torch.distributed.run import parse_args

    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    assert parse_args(["--nproc_per_node", "2", "x.py"]).signals_to_handle == launch.TORCH_DEFAULT_SIGNALS
    assert launch.leave_signals_to_eyas() == "SIGHUP,SIGQUIT"
    assert parse_args(["--nproc_per_node", "2", "x.py"]).signals_to_handle == "SIGHUP,SIGQUIT"
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1")  # a user's own list keeps its other signals
    assert launch.leave_signals_to_eyas() == "SIGUSR1"
    # an explicit flag is passed through unchanged and wins
    assert parse_args(["--signals-to-handle", "SIGTERM", "x.py"]).signals_to_handle == "SIGTERM"


def test_sigint_reaches_the_workers_as_sigterm():
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\nprint('ready', flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    # what the process had before (SIG_IGN, not Python's default, when pytest runs in the background under nohup)
    before = signal.getsignal(signal.SIGINT)
    # only this child: pytest's process may have others (a session's server) that must not be signalled
    stop = launch.StopRequest(children=lambda: [child.pid]).install()
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in launch.running_children()
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C, or `kill -INT`, sends the launcher
        assert child.wait(timeout=30) == 7  # SIGTERM's handler ran, not SIGINT's KeyboardInterrupt
        assert (stop.received, stop.signalled, stop.exit_status) == ("SIGINT", {child.pid}, 130)
    finally:
        stop.restore()
        child.kill()
        child.wait()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_with_no_worker_running_stops_the_launch():
    stop = launch.StopRequest(children=lambda: []).install()
    try:
        with pytest.raises(launch.StoppedWithoutWorkers):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises here, in the main thread, as it would inside the launcher
        stop.signalled.add(12345)  # the workers were signalled and have exited: a second signal changes nothing
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    finally:
        stop.restore()


def test_launcher_failures_give_the_workers_exit_codes():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=143, error_file="") for rank in (0, 1)}
    assert launch.stop_exit_codes(ChildFailedError("eyas.train", failures)) == [143, 143]
    assert launch.stop_exit_codes(subprocess.CalledProcessError(-15, ["python"])) == [-15]
    assert launch.stop_exit_codes(ValueError("not a worker's")) is None
    assert {143, -15} == launch.STOPPED_BEFORE_SAVE


def test_a_launcher_eyas_does_not_run_is_a_one_line_error(capsys):
    from eyas.cli.main import main

    assert main(["launch", "deepspeed", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and "runs 'torchrun ...' or 'accelerate launch ...'" in err
