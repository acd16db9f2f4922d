"""A real one-node SLURM cluster (Debian's slurmctld/slurmd, started by eyas.slurm.local_cluster).

The cluster fixture skips only when the SLURM programs are not installed (CI installs them with
`.ci/slurm_setup.sh`). The fast tests check the cluster settings the templates rely on (array
tasks side by side, afterok chains, a requeue restarting within seconds and appending to the same
log); the slow test runs the whole tiny pipeline through `eyas submit --stage all` and checks
preemption of the training job.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from eyas.slurm import local_cluster

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
    """Wait until every job (and array task) is in a final state; returns all their states."""
    deadline = time.monotonic() + timeout
    while True:
        states: dict[str, str] = {}
        for job_id in job_ids:
            states.update(job_states(cluster, job_id))
        if states and all(s in FINAL_STATES for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs not finished after {timeout:.0f} s: {states}")
        time.sleep(1.0)


def sbatch(cluster, script: Path, *options: str) -> str:
    return cluster.run("sbatch", "--parsable", *options, str(script)).stdout.strip().split(";")[0]


def test_cluster_runs_array_tasks_side_by_side_and_chains(slurm_cluster, tmp_path):
    script = tmp_path / "array.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --array=0-1\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --output={tmp_path}/a-%A_%a.out\n"
        'echo "task ${SLURM_ARRAY_TASK_ID} of ${SLURM_ARRAY_TASK_COUNT} start $(date +%s.%N)"; sleep 2\n'
    )
    after = tmp_path / "after.sbatch"
    after.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/after-%j.out\nls {tmp_path} | grep -c '^a-'\n")
    array_id = sbatch(slurm_cluster, script)
    after_id = sbatch(slurm_cluster, after, f"--dependency=afterok:{array_id}")
    states = wait_for(slurm_cluster, [array_id, after_id], timeout=90)
    assert set(states.values()) == {"COMPLETED"}, states
    starts = {}
    for task in (0, 1):
        text = (tmp_path / f"a-{array_id}_{task}.out").read_text()
        match = re.search(rf"task {task} of 2 start (\S+)", text)
        assert match, text
        starts[task] = float(match.group(1))
    assert abs(starts[0] - starts[1]) < 1.5  # two 1-CPU tasks on the 2-core node run together
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
    states = wait_for(slurm_cluster, [job_id], timeout=90)
    assert states == {job_id: "COMPLETED"}
    runs = re.findall(r"run (\d+) at (\d+)", log.read_text())
    assert [r for r, _ in runs] == ["0", "1"], log.read_text()
    assert int(runs[1][1]) - int(runs[0][1]) < 45  # cred_expire=10: no two-minute hold
