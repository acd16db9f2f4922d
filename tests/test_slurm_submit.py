"""`eyas submit` without a cluster: rendered scripts, chaining, resources and errors (--dry-run)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from eyas.config import load_recipe
from eyas.errors import EyasError
from eyas.slurm import submit


@pytest.fixture()
def recipe_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "subm", "output_dir": "runs"}, "train": {"lr": 2e-4}}))
    return path


def _dry(recipe_file: Path, *extra: str, capsys=None) -> tuple[int, str]:
    rc = submit.main([str(recipe_file), "--dry-run", *extra])
    out = capsys.readouterr() if capsys else None
    return rc, (out.out + out.err) if out else ""


def _slurm_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "subm" / "slurm"


def _directives(text: str) -> dict:
    """The `#SBATCH` options of a script, as sbatch reads them (options without a value map to True)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].strip().partition("=")
            out[key] = value or True
    return out


PYTHON_STUB = """#!{python}
# Stands in for the interpreter the scripts run: records argv and environment, and for a training
# process waits for USR1 or SIGTERM the way the trainer's handler does (checkpoint, then exit 0).
import json, os, signal, sys, time
log = os.environ["STUB_LOG"]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
        "ACCELERATE_USE_CPU", "OMP_NUM_THREADS", "SLURM_NODEID")
with open(log, "a") as f:
    f.write(json.dumps({{"cmd": "python", "argv": sys.argv[1:], "cwd": os.getcwd(),
                        "env": {{k: os.environ.get(k) for k in keys}}}}) + "\\n")
if os.environ.get("STUB_WAIT_USR1"):
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append("USR1"))
    signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
    with open(os.environ["STUB_PIDFILE"], "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(log, "a") as f:
        f.write(json.dumps({{"cmd": "python", "stopped_by": got[0] if got else None}}) + "\\n")
"""

SHELL_STUBS = {
    # srun on one node: drop srun's own options, run the command as node 0.
    "srun": 'printf "srun\\t%s\\n" "$*" >> "$STUB_LOG"\n'
            'while [ "${1#--}" != "$1" ]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
    "scontrol": 'printf "scontrol\\t%s\\n" "$*" >> "$STUB_LOG"\n'
                'if [ "$1" = show ]; then printf "node1\\nnode2\\n"; fi\n',
    "scancel": 'printf "scancel\\t%s\\n" "$*" >> "$STUB_LOG"\n'
               'if [ "$1" = --signal=USR1 ]; then kill -USR1 "$(cat "$STUB_PIDFILE")"; fi\n',
}
SLURM_ENV = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "2",
             "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "16", "SLURM_ARRAY_JOB_ID": "1200"}


@pytest.fixture()
def stubs(tmp_path, monkeypatch) -> Path:
    """`srun`, `scontrol`, `scancel` on PATH and a stub interpreter that the rendered scripts call."""
    import sys

    folder = tmp_path / "stubs"
    folder.mkdir()
    (folder / "python").write_text(PYTHON_STUB.format(python=sys.executable))
    for name, body in SHELL_STUBS.items():
        (folder / name).write_text("#!/bin/bash\n" + body)
    for path in folder.iterdir():
        path.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(folder / "python"))  # what the scripts are rendered to run
    return folder


def _run(script: Path, stubs: Path, background: bool = False, **env: str):
    log = stubs / "calls.jsonl"
    full = {**os.environ, **SLURM_ENV, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(log),
            "STUB_PIDFILE": str(stubs / "python.pid"), **env}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        if key not in env:
            full.pop(key, None)  # what the job inherits must come from the script, not from this test's shell
    if background:
        return subprocess.Popen(["bash", str(script)], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    res = subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return _calls(stubs)


def _calls(stubs: Path) -> list[dict]:
    log = stubs / "calls.jsonl"
    if not log.is_file():
        return []
    lines = log.read_text().splitlines()  # the interpreter stub writes JSON, the shell stubs `name<TAB>args`
    return [json.loads(line) if line.startswith("{") else dict(zip(("cmd", "argv"), line.split("\t", 1)))
            for line in lines]


def test_all_stages_chained_in_order_and_every_script_runs_its_stage(recipe_file, tmp_path, stubs, capsys):
    rc, out = _dry(recipe_file, "--stage", "all", "--gpus-per-node", "0", "--procs-per-node", "2", capsys=capsys)
    assert rc == 0, out
    lines = [line.split() for line in out.strip().splitlines()]
    names = [parts[0] for parts in lines]
    assert names == ["prepare", "dump", "dump_finalize", "train", "eval", "export"]
    # Each job after the first depends on the one before it.
    for previous, parts in zip(names, lines[1:]):
        assert f"--dependency=afterok:<{previous}>" in parts
    assert "--dependency" not in " ".join(lines[0])
    slurm_dir = _slurm_dir(tmp_path)
    recipe = str(slurm_dir / "recipe.yaml")
    for name in names:
        script = slurm_dir / f"{name}.sbatch"
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, name
        options = _directives(script.read_text())
        assert options["--open-mode"] == "append" and options["--requeue"] is True, name
        assert options["--output"].startswith(f"{slurm_dir / 'logs'}/"), name
        if name == "train":
            continue  # run below, with its launcher
        (stubs / "calls.jsonl").unlink(missing_ok=True)
        calls = _run(script, stubs)
        command = ["dump", "--finalize"] if name == "dump_finalize" else [name]
        assert [c["argv"] for c in calls] == [["-m", "eyas.cli", *command, recipe]], name
        assert calls[0]["cwd"] == str(tmp_path)  # jobs start in the submit directory
    # A dump array task is rank SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT, with no rendezvous to wait for.
    (stubs / "calls.jsonl").unlink()
    env = _run(slurm_dir / "dump.sbatch", stubs, MASTER_ADDR="stale", MASTER_PORT="1")[0]["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "16", "0")
    assert env["MASTER_ADDR"] is None and env["MASTER_PORT"] is None


def test_train_script_cpu_launcher(recipe_file, tmp_path, stubs, capsys):
    rc, _ = _dry(recipe_file, "--stage", "train", "--gpus-per-node", "0", "--procs-per-node", "2",
                 "--signal-seconds", "90", capsys=capsys)
    assert rc == 0
    script = _slurm_dir(tmp_path) / "train.sbatch"
    options = _directives(script.read_text())
    assert (options["--nodes"], options["--ntasks-per-node"], options["--cpus-per-task"]) == ("1", "1", "2")
    assert options["--signal"] == "B:USR1@90" and not any(k.startswith("--gpu") for k in options)
    calls = _run(script, stubs)
    assert [c["cmd"] for c in calls] == ["scontrol", "srun", "python"]
    assert calls[0]["argv"] == "show hostnames node[1-2]"
    python = calls[2]
    port = str(20000 + 1234 % 20000)
    assert python["argv"] == ["-m", "eyas.cli", "launch", "torchrun", "--node-rank=0", "--nnodes", "1",
                              "--nproc-per-node", "2", "--master-addr", "node1", "--master-port", port,
                              "-m", "eyas.train", str(_slurm_dir(tmp_path) / "recipe.yaml")]
    env = python["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["ACCELERATE_USE_CPU"] == "true"  # gloo on CPU nodes
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == ("node1", port, "1")


def _start_train_script(recipe_file, tmp_path, stubs, capsys):
    """The rendered train script running in the background, once its (stub) launcher has started:
    (the script's process, the launcher's pid file)."""
    import time

    rc, _ = _dry(recipe_file, "--stage", "train", "--procs-per-node", "2", capsys=capsys)
    assert rc == 0
    proc = _run(_slurm_dir(tmp_path) / "train.sbatch", stubs, background=True, STUB_WAIT_USR1="1")
    pidfile = stubs / "python.pid"
    deadline = time.monotonic() + 60
    while not pidfile.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert pidfile.is_file(), proc.communicate()[0]
    return proc, pidfile


def test_usr1_checkpoints_through_the_launcher_then_requeues(recipe_file, tmp_path, stubs, capsys):
    import signal

    proc, pidfile = _start_train_script(recipe_file, tmp_path, stubs, capsys)
    proc.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@...` sends to the batch script
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    calls = _calls(stubs)
    assert {"cmd": "scancel", "argv": "--signal=USR1 1234"} in calls  # passed on to the job's steps
    assert {"cmd": "python", "stopped_by": "USR1"} in calls  # the training process received it
    assert calls[-1] == {"cmd": "scontrol", "argv": "requeue 1234"}  # and only then the job was requeued
    assert "requeueing job 1234" in output


def test_sigterm_waits_for_the_launchers_and_does_not_requeue(recipe_file, tmp_path, stubs, capsys):
    """scancel or a preemption: SLURM sends SIGTERM to every process of the job, the batch script too."""
    import signal

    proc, pidfile = _start_train_script(recipe_file, tmp_path, stubs, capsys)
    proc.send_signal(signal.SIGTERM)
    os.kill(int(pidfile.read_text()), signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output  # the script outlived its own SIGTERM and exited with the launcher's 0
    calls = _calls(tmp_path / "stubs")
    assert {"cmd": "python", "stopped_by": "TERM"} in calls
    assert not any(c["cmd"] in ("scontrol", "scancel") and "show" not in c["argv"] for c in calls)  # no requeue
    assert "SIGTERM received" in output and "launchers exited with status 0" in output


def test_gpu_resources_per_stage(recipe_file, tmp_path, stubs, capsys):
    rc, _ = _dry(recipe_file, "--stage", "all", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                 "--time", "4:00:00", "--sbatch-arg=--qos=high", "--launcher", "accelerate", capsys=capsys)
    assert rc == 0
    slurm_dir = _slurm_dir(tmp_path)
    options = {name: _directives((slurm_dir / f"{name}.sbatch").read_text())
               for name in ("prepare", "dump", "dump_finalize", "train", "eval", "export")}
    train = options["train"]
    assert (train["--gpus-per-node"], train["--nodes"], train["--cpus-per-task"]) == ("8", "2", "64")
    assert (options["dump"]["--array"], options["dump"]["--gpus"], options["dump"]["--cpus-per-task"]) == \
        ("0-15", "1", "8")
    assert options["eval"]["--gpus"] == "1"
    for name in ("prepare", "dump_finalize", "export"):  # the finalize job loads no weights
        assert not any(k.startswith("--gpu") for k in options[name]), name
    for name, opts in options.items():
        assert (opts["--partition"], opts["--time"], opts["--qos"]) == ("gpu", "4:00:00", "high"), name
    python = _run(slurm_dir / "train.sbatch", stubs)[-1]
    argv = python["argv"]
    assert argv[:6] == ["-m", "eyas.cli", "launch", "accelerate", "launch", "--machine_rank=0"]
    assert argv[argv.index("--num_machines") + 1] == "2" and argv[argv.index("--num_processes") + 1] == "16"
    assert "--cpu" not in argv and python["env"]["CUDA_VISIBLE_DEVICES"] is None
    assert python["env"]["OMP_NUM_THREADS"] == "8"  # 64 CPUs over 8 processes


def test_a_vllm_dump_task_holds_its_tensor_parallel_gpus(recipe_file, tmp_path, capsys):
    rc, _ = _dry(recipe_file, "--stage", "dump", "--nodes", "2", "--gpus-per-node", "8", "dump.backend=vllm",
                 "dump.vllm_tensor_parallel_size=4", capsys=capsys)
    assert rc == 0
    dump = _directives((_slurm_dir(tmp_path) / "dump.sbatch").read_text())
    # 16 GPUs, 4 per engine: 4 tasks, each with its 4 GPUs and 8 CPUs per GPU
    assert (dump["--array"], dump["--gpus"], dump["--cpus-per-task"]) == ("0-3", "4", "32")
    rc, out = _dry(recipe_file, "--stage", "dump", "--gpus-per-node", "2", "dump.backend=vllm",
                   "dump.vllm_tensor_parallel_size=4", capsys=capsys)
    assert rc == 2 and "dump.vllm_tensor_parallel_size" in out and "--gpus-per-node 2" in out


def test_resolved_recipe_keeps_overrides_with_absolute_run_dir(recipe_file, tmp_path, capsys):
    rc, _ = _dry(recipe_file, "--stage", "eval", "train.lr=3e-4", "eval.max_prompts=7", capsys=capsys)
    assert rc == 0
    resolved = load_recipe(_slurm_dir(tmp_path) / "recipe.yaml")
    assert resolved.train.lr == 3e-4 and resolved.eval.max_prompts == 7
    assert resolved.run.output_dir == str(tmp_path / "runs")
    assert resolved.run_dir == tmp_path / "runs" / "subm"


def test_online_training_skips_dump(recipe_file, capsys):
    rc, out = _dry(recipe_file, "--stage", "all", "train.source=online", capsys=capsys)
    assert rc == 0
    assert [line.split()[0] for line in out.strip().splitlines()] == ["prepare", "train", "eval", "export"]


def test_comma_list_is_put_in_pipeline_order(recipe_file, capsys):
    rc, out = _dry(recipe_file, "--stage", "dump,prepare", capsys=capsys)
    assert rc == 0
    assert [line.split()[0] for line in out.strip().splitlines()] == ["prepare", "dump", "dump_finalize"]


@pytest.mark.parametrize("args, message", [
    (["--stage", "trian"], "--stage 'trian' is not a stage"),
    (["--gpus-per-node", "4", "--procs-per-node", "2"], "--procs-per-node 2 differs from --gpus-per-node 4"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--sbatch-arg", "qos=high"], "--sbatch-arg 'qos=high' must be one sbatch option"),
    (["--launcher", "accelerate", "--accelerate-config", "nope.yaml"],
     "--accelerate-config 'nope.yaml' does not exist"),
])
def test_bad_options_are_one_line_errors(recipe_file, capsys, args, message):
    rc, out = _dry(recipe_file, *args, capsys=capsys)
    assert rc == 2
    assert message in out and "Traceback" not in out


def test_missing_sbatch_is_a_clear_error(recipe_file, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    rc = submit.main([str(recipe_file), "--stage", "eval"])
    assert rc == 2
    assert "'sbatch' is not on PATH" in capsys.readouterr().err


def test_render_refuses_unfilled_placeholders():
    with pytest.raises(EyasError, match="placeholder '{{nodes}}' has no value"):
        submit.render("#SBATCH --nodes={{nodes}}", {})
    assert submit.render("a {{x}} b {{x}}", {"x": 3}) == "a 3 b 3"
