"""A real one-node SLURM cluster (Debian's slurmctld/slurmd, started by eyas.slurm.local_cluster).

The cluster fixture skips only when the SLURM programs are not installed (CI installs them with
`.ci/slurm_setup.sh`). The fast tests check the cluster settings the templates rely on (array
tasks side by side, afterok chains, a requeue restarting within seconds and appending to the same
log); the slow test runs the whole tiny pipeline through `eyas submit --stage all` and checks
preemption of the training job.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from train_helpers import pause_training_at

from eyas.slurm import local_cluster
from eyas.vllm_server import free_port

pytestmark = pytest.mark.cluster

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = local_cluster.missing_binaries()
    if missing:
        pytest.skip(f"SLURM is not installed (missing {', '.join(missing)}); run .ci/slurm_setup.sh "
                    "(apt-get install -y slurmctld slurmd slurm-client)")
    cluster = local_cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
        for pid_file in local_cluster.PID_FILES.values():
            assert not (cluster.directory / pid_file).exists()


def job_states(cluster, job_id: str) -> dict[str, str]:
    """{job or array task id: state} from `scontrol show job` (records kept for an hour, MinJobAge)."""
    out = cluster.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        key = fields.get("JobId", "")
        if fields.get("ArrayTaskId"):
            key = f"{fields.get('ArrayJobId')}_{fields['ArrayTaskId']}"
        states[key] = fields.get("JobState", "")
    return states


def wait_for(cluster, job_ids: list[str], timeout: float) -> dict[str, str]:
    """Wait until every job (and array task) is in a final state; returns all their states.

    A job that `scontrol` did not report this round (a busy controller times out) counts as
    not finished, so a transient failure cannot end the wait early.
    """
    deadline = time.monotonic() + timeout
    while True:
        states: dict[str, str] = {}
        reported = True
        for job_id in job_ids:
            found = job_states(cluster, job_id)
            reported = reported and any(k == job_id or k.startswith(job_id + "_") for k in found)
            states.update(found)
        if reported and all(s in FINAL_STATES for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs not finished after {timeout:.0f} s: {states}")
        time.sleep(1.0)


def sbatch(cluster, script: Path, *options: str) -> str:
    return cluster.run("sbatch", "--parsable", *options, str(script)).stdout.strip().split(";")[0]


def test_cluster_runs_array_tasks_side_by_side_and_chains(slurm_cluster, tmp_path):
    script = tmp_path / "array.sbatch"
    started = tmp_path / "started"
    started.mkdir()
    # Each task marks its start, then waits (up to 60 s) for the other's mark before it ends. Task 0
    # seeing task 1's mark while running, and task 1 seeing task 0's, means their runs overlapped
    # however slowly each started; run one after the other, the first would never see the second.
    script.write_text(
        "#!/bin/bash\n#SBATCH --array=0-1\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --output={tmp_path}/a-%A_%a.out\n"
        'me=${SLURM_ARRAY_TASK_ID}; other=$((1 - me))\n'
        'echo "task ${me} of ${SLURM_ARRAY_TASK_COUNT} start"\n'
        f'touch {started}/$me\n'
        f'for _ in $(seq 600); do [ -e {started}/$other ] && break; sleep 0.1; done\n'
        f'if [ -e {started}/$other ]; then echo "task $me saw task $other running"; fi\n'
    )
    after = tmp_path / "after.sbatch"
    after.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/after-%j.out\nls {tmp_path} | grep -c '^a-'\n")
    array_id = sbatch(slurm_cluster, script)
    after_id = sbatch(slurm_cluster, after, f"--dependency=afterok:{array_id}")
    # room for a task that waits out its 60 s, so tasks run one after the other fail below, not here
    states = wait_for(slurm_cluster, [array_id, after_id], timeout=180)
    assert set(states.values()) == {"COMPLETED"}, states
    for task in (0, 1):
        text = (tmp_path / f"a-{array_id}_{task}.out").read_text()
        assert f"task {task} of 2 start" in text, text
        # two 1-CPU tasks on the 2-core node run together
        assert f"task {task} saw task {1 - task} running" in text, text
    assert (tmp_path / f"after-{after_id}.out").read_text().strip() == "2"


def test_requeued_job_restarts_within_seconds_and_appends(slurm_cluster, tmp_path):
    script = tmp_path / "requeue.sbatch"
    log = tmp_path / "requeue.out"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n#SBATCH --output={log}\n"
        'echo "run ${SLURM_RESTART_COUNT:-0} at $(date +%s)"\n'
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then scontrol requeue "${SLURM_JOB_ID}"; sleep 30; fi\n'
    )
    job_id = sbatch(slurm_cluster, script)
    # long enough for a rerun held back two minutes to finish, so a hold fails the checks below
    states = wait_for(slurm_cluster, [job_id], timeout=300)
    assert states == {job_id: "COMPLETED"}
    runs = re.findall(r"run (\d+) at (\d+)", log.read_text())
    assert [r for r, _ in runs] == ["0", "1"], log.read_text()
    # The hold as the controller recorded it: at the requeue it resets SubmitTime and makes the job
    # eligible cred_expire + 1 s later (11 s here; 121 s with the default cred_expire=120).
    record = dict(re.findall(r"(\w+)=(\S*)", slurm_cluster.run("scontrol", "-o", "show", "job", job_id).stdout))
    seconds = {key: datetime.fromisoformat(record[key]).timestamp() for key in ("SubmitTime", "EligibleTime")}
    assert record["Restarts"] == "1" and seconds["EligibleTime"] - seconds["SubmitTime"] < 60, record
    # The rerun itself started before a two-minute hold could have ended (about 15 s here, the rest
    # is room for a loaded machine; the default hold alone puts the rerun over 120 s after run 0).
    assert int(runs[1][1]) - int(runs[0][1]) < 120


# ----------------------------------------------------------------------------- the whole pipeline

TRAIN_STEPS = 20
# The preempted training waits after this step until its USR1 arrives (train_helpers.pause_training_at),
# so the signal lands mid-run at a known step on a machine of any speed; past the first periodic
# checkpoint (step 5) and off the save steps, so the preemption writes a checkpoint of its own.
PAUSE_AT = 7


def _tiny_recipe(path: Path, runs: Path, name: str, target: Path) -> Path:
    import yaml

    recipe = {
        "run": {"name": name, "output_dir": str(runs), "seed": 0},
        "target": {"path": str(target)},
        "data": {"source": "chitchat", "max_samples": 80, "max_length": 96, "heldout_fraction": 0.1},
        "dump": {"draft_vocab_size": 128, "token_budget": 1024, "shard_tokens": 1024},
        "draft": {"kind": "eagle3"},
        "train": {"max_steps": TRAIN_STEPS, "token_budget": 384, "lr": 1.0e-3, "warmup_steps": 2, "ttt_steps": 3,
                  "save_every": 5, "eval_every": 0, "eval_batches": 2, "log_every": 5, "prefetch": 0},
        "eval": {"max_prompts": 2, "max_new_tokens": 8, "shapes": ["chain:3"]},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def _submit(args: list[str]) -> dict:
    from eyas.slurm import submit

    assert submit.main(args) == 0
    return args


def _jobs(run_dir: Path) -> dict:
    return json.loads((run_dir / "slurm" / "jobs.json").read_text())["jobs"]


def _log(run_dir: Path, pattern: str) -> list[Path]:
    return sorted((run_dir / "slurm" / "logs").glob(pattern))


def _text(log: Path) -> str:
    """A job log as text; two ranks writing progress bars at once can split a multi-byte character."""
    return log.read_bytes().decode("utf-8", errors="replace")


def _wait_for_file(path_glob: tuple[Path, str], timeout: float, cluster, job_id: str) -> None:
    folder, pattern = path_glob
    deadline = time.monotonic() + timeout
    while not list(folder.glob(pattern)):
        states = job_states(cluster, job_id)
        if states and all(s in FINAL_STATES for s in states.values()):
            raise AssertionError(f"job {job_id} ended ({states}) before {folder}/{pattern} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"{folder}/{pattern} did not appear within {timeout:.0f} s")
        time.sleep(0.5)


def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


@pytest.mark.slow
def test_submit_all_on_a_real_cluster_with_preemption(slurm_cluster, tmp_path, tiny_llama_dir, monkeypatch):
    """prepare -> 2-task dump array -> finalize -> 2-process training (preempted by USR1, requeued,
    resumed) -> eval -> export, all through `eyas submit --stage all`; then the same training
    uninterrupted in another run directory ends with the same weights."""
    import shutil

    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    # sbatch passes the submitting environment on to every job, and srun and the launcher to the workers
    pause = tmp_path / "pause"
    for key, value in pause_training_at(PAUSE_AT, pause, dict(os.environ)).items():
        monkeypatch.setenv(key, value)
    runs = tmp_path / "runs"
    recipe = _tiny_recipe(tmp_path / "tiny.yaml", runs, "slurm-tiny", tiny_llama_dir)
    _submit([str(recipe), "--stage", "all", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2",
             "--dump-tasks", "2"])
    run_dir = runs / "slurm-tiny"
    jobs = _jobs(run_dir)
    assert list(jobs) == ["prepare", "dump", "dump_finalize", "train", "eval", "export"]

    # Preempt the training job once a rank waits at PAUSE_AT; the requeued run resumes past it and does not wait.
    _wait_for_file((pause, "rank*"), 600, slurm_cluster, jobs["train"])
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", jobs["train"])
    states = wait_for(slurm_cluster, list(jobs.values()), timeout=900)
    assert set(states.values()) == {"COMPLETED"}, states
    assert len([k for k in states if k.startswith(jobs["dump"] + "_")]) == 2  # two array tasks

    # prepare + dump: both array tasks did part of the work, and the manifest was written once every shard existed.
    info = json.loads((run_dir / "prepared" / "info.json").read_text())
    manifest = json.loads((run_dir / "shards" / "manifest.json").read_text())
    assert manifest["num_samples"] == info["splits"]["train"]["samples"] > 0
    shards = len(manifest["shards"])
    assert shards >= 2
    logs = _log(run_dir, f"dump-{jobs['dump']}_*.out")
    assert [f"array task {rank} of 2" in _text(log) for rank, log in enumerate(logs)] == [True, True]
    # Task 0 ran its half (shards i % 2 == 0) from scratch. Who writes the manifest depends on which task
    # ends last: if task 1 was done when task 0 ended, task 0 wrote it (every shard existed) and the finalize
    # job found the dump current; otherwise the single-process finalize found every shard done (so task 1
    # wrote the other half) and only wrote the manifest.
    task0 = _text(logs[0])
    assert f"train: {shards} shards, {(shards + 1) // 2} for this process (0 already done)" in task0
    finalize = _text(_log(run_dir, f"dump-finalize-{jobs['dump_finalize']}.out")[0])
    if f"eyas dump: {manifest['num_samples']} samples" in task0:
        assert "skipped: " in finalize and "is current for these settings" in finalize, finalize
    else:
        assert "written by other tasks" in task0
        assert f"train: {shards} shards, {shards} for this process ({shards} already done), 0 tokens to run" in finalize

    # train: preempted, requeued, resumed from the checkpoint it saved, one log appended across runs.
    train_log = _text(_log(run_dir, f"train-{jobs['train']}.out")[0])
    assert "restart 0 on" in train_log and "restart 1 on" in train_log
    assert "USR1 received" in train_log and f"requeueing job {jobs['train']}" in train_log
    stopped = int(re.search(r"SIGUSR1 at step (\d+): saved", train_log).group(1))
    resumed = int(re.search(r"resumed from \S+ \(step (\d+)\)", train_log).group(1))
    assert stopped == resumed == PAUSE_AT
    assert f"done at step {TRAIN_STEPS}" in train_log

    # eval + export ran on the trained draft.
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["settings"]["drafts"] == [str(run_dir / "checkpoints" / "best")]
    assert report["configs"][0]["overall"]["tau"] >= 1.0
    config = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]

    # The same training without interruption, on the same prepared data and shards.
    monkeypatch.delenv("EYAS_TEST_PAUSE_DIR")  # no pause
    ref_recipe = _tiny_recipe(tmp_path / "ref.yaml", runs, "slurm-ref", tiny_llama_dir)
    ref_dir = runs / "slurm-ref"
    ref_dir.mkdir(parents=True)
    shutil.copytree(run_dir / "prepared", ref_dir / "prepared")
    shutil.copytree(run_dir / "shards", ref_dir / "shards")
    _submit([str(ref_recipe), "--stage", "train", "--gpus-per-node", "0", "--procs-per-node", "2"])
    ref_job = _jobs(ref_dir)["train"]
    assert wait_for(slurm_cluster, [ref_job], timeout=600) == {ref_job: "COMPLETED"}
    assert "restart 1" not in _text(_log(ref_dir, f"train-{ref_job}.out")[0])
    final = f"step_{TRAIN_STEPS:08d}"
    preempted, uninterrupted = _weights(run_dir / "checkpoints" / final), _weights(ref_dir / "checkpoints" / final)
    assert preempted.keys() == uninterrupted.keys()
    for name in preempted:
        assert torch.equal(preempted[name], uninterrupted[name]), name


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_streamed_training_job_places_its_engine_and_trainer(slurm_cluster, tmp_path, monkeypatch):
    """`eyas submit --stage prepare,train` of a `train.source: stream` recipe: the training job starts its capture
    engine as a job step (`eyas engine`) beside the trainer, which trains every step from it; no dump runs."""
    import yaml
    from fixtures import build_tiny_target

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    # head_dim 64: vLLM's CPU attention takes no smaller head
    target = build_tiny_target(tmp_path / "target", "llama", hidden_size=128, intermediate_size=256,
                               num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=8)
    runs = tmp_path / "runs"
    recipe = yaml.safe_load(_tiny_recipe(tmp_path / "tiny.yaml", runs, "slurm-stream", target).read_text())
    recipe["target"]["dtype"] = "float32"
    recipe["dump"]["vllm_enforce_eager"] = True
    recipe["train"].update(source="stream", stream_engines=1, stream_port=free_port(), max_steps=8, save_every=0)
    path = tmp_path / "stream.yaml"
    path.write_text(yaml.safe_dump(recipe))
    _submit([str(path), "--stage", "prepare,train", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "1"])
    run_dir = runs / "slurm-stream"
    jobs = _jobs(run_dir)
    assert list(jobs) == ["prepare", "train"]
    states = wait_for(slurm_cluster, list(jobs.values()), timeout=1000)
    log = _text(_log(run_dir, f"train-{jobs['train']}.out")[0])
    assert set(states.values()) == {"COMPLETED"}, log[-3000:]
    assert "capture engines at http://" in log and "eyas engine: capturing layers" in log
    report = json.loads((run_dir / "stream" / "report.rank0.json").read_text())
    assert report["fleet"]["captures"] > 0 and sum(report["train"]["trained"]) > 0
    assert not (run_dir / "shards").exists()
