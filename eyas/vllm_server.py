"""vLLM processes eyas starts and stops: the OpenAI server (`VllmServer`), the environment every vLLM child gets on a
CPU (`child_env`), and stopping a child's whole process group (`stop_process`). Shared by eval (vLLM's acceptance
of an export), prepare's regeneration tests and train's streamed source (capture engines)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.vllm_install import require_vllm, vllm_python

LOG_TAIL = 40  # lines of a vLLM log quoted in an error


def _log_tail(log: Path, lines: int = LOG_TAIL) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def child_env(kv_cache_gib: float, threads: int | None) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine core in the child itself: one log, one PID
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a child we started and everything in its process group (it has its own session):
    SIGTERM, up to 20 s for the group to go, then SIGKILL."""
    def group_alive() -> bool:
        try:
            os.killpg(proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    if proc.poll() is None or group_alive():
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (proc.poll() is None or group_alive()):
            time.sleep(0.2)
        if group_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(timeout=20)
    deadline = time.monotonic() + 10
    while group_alive() and time.monotonic() < deadline:  # children re-parented to init are reaped by it
        time.sleep(0.2)


def answers(url: str, timeout: float = 5) -> bool:
    """Whether the OpenAI server at `url` (`http://HOST:PORT/v1`) is up: its `/models` answers 200."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/models", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (or `host`), started and stopped by PID.

        with VllmServer(target, log=path) as server:
            ... server.url ...          # http://127.0.0.1:PORT/v1

    Does not come up within `timeout` seconds: the process group is stopped and EyasError names
    the port with the log's last lines. `in_process_engine`: the engine runs in the server's own
    process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one process, where by default an engine-core and a
    worker process each kept a core busy here (benchmarks/study_widened.py generates this way; the
    two were not timed against each other).
    """

    def __init__(self, target: str | Path, log: str | Path, port: int = 0, dtype: str = "float32",
                 max_model_len: int = 2048, timeout: float = 600, kv_cache_gib: float = 1,
                 extra_args: list[str] | None = None, served_name: str = "target",
                 in_process_engine: bool = False, host: str = "127.0.0.1", eager: bool = True) -> None:
        self.target, self.log, self.port = str(target), Path(log), port or free_port()
        self.dtype, self.max_model_len, self.timeout = dtype, max_model_len, timeout
        self.kv_cache_gib, self.extra_args, self.served_name = kv_cache_gib, list(extra_args or []), served_name
        self.in_process_engine, self.host, self.eager = in_process_engine, host, eager
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        # the address this machine reaches it at (a server on every interface is reached on loopback here)
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VllmServer:
        python = vllm_python()
        require_vllm(python)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.target, "--host", self.host,
                   "--port", str(self.port), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                   "--served-model-name", self.served_name, *(["--enforce-eager"] if self.eager else []), "--seed", "0",
                   "--disable-uvicorn-access-log", *self.extra_args]
        env = child_env(self.kv_cache_gib, None)
        if not self.in_process_engine:
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server keeps its engine core process (same group)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise EyasError(f"vLLM's server on 127.0.0.1:{self.port} exited with status {self.proc.returncode} "
                                f"before it came up; last lines of {self.log}:\n{_log_tail(self.log)}")
            if answers(self.url):
                return self
            time.sleep(1.0)
        self.stop()
        raise EyasError(f"vLLM's server on 127.0.0.1:{self.port} did not come up in {self.timeout:.0f} s and was "
                        f"stopped; last lines of {self.log}:\n{_log_tail(self.log)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


