"""A one-node SLURM cluster in a temporary directory, for tests and for trying `eyas submit`.

It installs nothing: it needs Debian's (or any) `slurmctld`, `slurmd` and the client
commands on PATH (`apt-get install -y slurmctld slurmd slurm-client`, see
`.ci/slurm_setup.sh`). Everything the daemons write (config, state, spool, logs, PID
files) lives under one directory, and the clients find the cluster through the
`SLURM_CONF` environment variable, so a host's own SLURM configuration is never touched.

Settings that make a one-node cluster start in about a second without munge or cgroups
(see docs/design.md, "Real parts"): `AuthType=auth/none`, `CredType=cred/none`,
`ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`, `SelectType=select/cons_tres`
with cores as the consumable (so two one-CPU array tasks run side by side), the node line
taken from `slurmd -C`, `MailProg=/bin/true`; `AuthInfo=cred_expire=10` and
`SchedulerParameters=sched_interval=5` make a requeued job start again within seconds
(the default credential lifetime holds a requeued job back for two minutes).

    python -m eyas.slurm.local_cluster start /tmp/eyas-slurm   # prints `export SLURM_CONF=...`
    python -m eyas.slurm.local_cluster stop /tmp/eyas-slurm    # cancels jobs, stops daemons by PID
"""

from __future__ import annotations

import argparse
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eyas.errors import EyasError
from eyas.io import pid_alive

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
PID_FILES = {"slurmctld": "slurmctld.launcher.pid", "slurmd": "slurmd.launcher.pid"}


def missing_binaries() -> list[str]:
    """SLURM programs this module needs that are not on PATH (daemons live in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/usr/local/sbin"
    return [name for name in DAEMONS + CLIENTS if shutil.which(name, path=path) is None]


def _binary(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/usr/local/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise EyasError(f"'{name}' is not installed; "
                        "install SLURM with: apt-get install -y slurmctld slurmd slurm-client")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_line() -> str:
    """`NodeName=<host> CPUs=.. RealMemory=..` as `slurmd -C` reports this machine."""
    out = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    first = out.splitlines()[0].strip()
    host = socket.gethostname().split(".")[0]
    if not first.startswith("NodeName="):
        raise EyasError(f"'slurmd -C' printed an unexpected line: {first!r}")
    # The node name must equal `hostname -s`, which slurmd uses to find its own line.
    fields = first.split()[1:]
    return " ".join([f"NodeName={host}", "NodeAddr=127.0.0.1"] + fields)


def render_conf(directory: Path, ctld_port: int, slurmd_port: int, node: str) -> str:
    user = getpass.getuser()
    host = node.split()[0].split("=", 1)[1]
    settings = {
        "ClusterName": "eyas",
        "SlurmctldHost": f"{host}(127.0.0.1)",
        "SlurmctldPort": ctld_port,
        "SlurmdPort": slurmd_port,
        "SlurmUser": user,
        "SlurmdUser": user,
        "AuthType": "auth/none",
        "CredType": "cred/none",
        "AuthInfo": "cred_expire=10",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "SchedulerType": "sched/backfill",
        "SchedulerParameters": "sched_interval=5",
        "MailProg": "/bin/true",
        "MpiDefault": "none",
        "ReturnToService": 2,
        "JobRequeue": 1,
        "KillWait": 5,
        "MinJobAge": 3600,
        "InactiveLimit": 0,
        "AccountingStorageType": "accounting_storage/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "JobCompType": "jobcomp/none",
        "StateSaveLocation": directory / "state",
        "SlurmdSpoolDir": directory / "spool",
        "SlurmctldPidFile": directory / "slurmctld.pid",
        "SlurmdPidFile": directory / "slurmd.pid",
        "SlurmctldLogFile": directory / "slurmctld.log",
        "SlurmdLogFile": directory / "slurmd.log",
        "SlurmctldDebug": "info",
        "SlurmdDebug": "info",
    }
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines.append(node)
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class LocalCluster:
    """A running one-node cluster; `env` is os.environ plus SLURM_CONF pointing at it."""

    directory: Path
    pids: dict = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=check)

    def node_state(self) -> str:
        res = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return res.stdout.strip()

    def stop(self) -> None:
        stop(self.directory)


def _spawn(name: str, args: list[str], directory: Path, env: dict) -> int:
    log = open(directory / f"{name}.stdout", "ab")
    # A new session, so a Ctrl-C in the caller's terminal does not reach the daemons half-way.
    proc = subprocess.Popen([_binary(name)] + args, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    (directory / PID_FILES[name]).write_text(str(proc.pid))
    return proc.pid


def _alive(pid: int) -> bool:
    if not pid_alive(pid):
        return False
    # A zombie child of ours still answers kill(0); reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def start(directory: str | Path, timeout: float = 60) -> LocalCluster:
    """Write a config under `directory`, start slurmctld then slurmd, wait until the node is idle."""
    missing = missing_binaries()
    if missing:
        raise EyasError(f"SLURM is not installed (missing: {', '.join(missing)}); "
                        "install it with: apt-get install -y slurmctld slurmd slurm-client")
    directory = Path(directory).resolve()
    for sub in ("state", "spool"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    conf = directory / "slurm.conf"
    conf.write_text(render_conf(directory, _free_port(), _free_port(), node_line()))
    cluster = LocalCluster(directory)
    env = cluster.env
    # -i: ignore state left by an earlier cluster in this directory; -D: stay in the foreground.
    cluster.pids["slurmctld"] = _spawn("slurmctld", ["-D", "-i", "-f", str(conf)], directory, env)
    _wait(lambda: cluster.run("scontrol", "ping", check=False).stdout.find("UP") >= 0, timeout,
          "slurmctld did not answer 'scontrol ping'", directory, cluster)
    cluster.pids["slurmd"] = _spawn("slurmd", ["-D", "-f", str(conf)], directory, env)
    _wait(lambda: cluster.node_state() in ("idle", "mix", "alloc"), timeout,
          "the node did not become idle", directory, cluster)
    return cluster


def _wait(ready, timeout: float, what: str, directory: Path, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, pid in cluster.pids.items():
            if not _alive(pid):
                stop(directory)
                raise EyasError(f"{name} exited during start-up; see {directory / (name + '.log')}")
        if ready():
            return
        time.sleep(0.2)
    stop(directory)
    raise EyasError(f"local SLURM cluster: {what} within {timeout:.0f} s; see the logs in {directory}")


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def stop(directory: str | Path, timeout: float = 30) -> None:
    """Cancel the cluster's jobs, then stop slurmd and slurmctld by the PIDs recorded at start."""
    directory = Path(directory).resolve()
    env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
    pids = {name: _read_pid(directory / PID_FILES[name]) for name in DAEMONS}
    if pids["slurmctld"] and _alive(pids["slurmctld"]) and shutil.which("scancel"):
        # Jobs' processes belong to slurmstepd, not to us: cancelling lets SLURM end them.
        subprocess.run(["scancel", "--full", "--user", getpass.getuser()], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
            if res.returncode != 0 or not res.stdout.strip():
                break
            time.sleep(0.5)
    for name in ("slurmd", "slurmctld"):
        pid = pids[name]
        if pid is None:
            continue
        _terminate(pid, timeout)
        (directory / PID_FILES[name]).unlink(missing_ok=True)


def _terminate(pid: int, timeout: float) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas.slurm.local_cluster", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("directory", help="folder for the config, state, logs and PID files")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            cluster = start(args.directory)
            print(f"export SLURM_CONF={cluster.conf}")
            print(f"# slurmctld pid {cluster.pids['slurmctld']}, slurmd pid {cluster.pids['slurmd']}; "
                  f"stop with: python -m eyas.slurm.local_cluster stop {cluster.directory}", file=sys.stderr)
        else:
            stop(args.directory)
    except EyasError as exc:
        print(f"eyas: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
