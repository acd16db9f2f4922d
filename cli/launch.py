"""`eyas launch LAUNCHER ...`: run `torchrun` or `accelerate launch` so that SIGTERM or SIGINT ends it clean.

    eyas launch torchrun --nproc_per_node 8 -m eyas.train RECIPE
    eyas launch accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 8 -m eyas.train RECIPE

Everything after `eyas launch` is the launcher's own command line, passed through unchanged, and
the launcher runs in this process (torch's `torch.distributed.run.main`, accelerate's
`launch_command`). What changes is who handles SIGTERM and SIGINT:

- Plain torchrun turns them into its `SignalException`: it passes the signal on to the workers
  (SIGINT as SIGINT, which a training process takes as an interrupt and exits without saving),
  SIGKILLs any worker still running after its shutdown timeout (30 s), then raises: a traceback
  and a non-zero exit, which a scheduler counts as a failed job, even when the workers saved.
- Here torchrun is told to leave the two signals alone (its `--signals-to-handle` default, read
  from PET_SIGNALS_TO_HANDLE, minus SIGTERM and SIGINT; a `--signals-to-handle` flag you pass
  wins). eyas sends SIGTERM to each worker instead (for SIGINT too: SIGTERM is the signal eyas's
  training loop checkpoints on) and lets the launcher go on watching them, with no deadline: each
  finishes its step, saves and exits 0, so the launcher returns as after any finished run and
  eyas prints one line and exits 0. A worker that fails keeps the launcher's own report and
  non-zero exit. Workers that stop with eyas's exit for a stop before a save (143: at start-up, or
  a dump, which keeps its finished files) end the launch with one line and 128 + the signal's number.

SIGHUP and SIGQUIT keep torchrun's handling: SIGQUIT (Ctrl-\\) stops the workers at once.
A Ctrl-C at a terminal reaches only the launcher: torchrun starts each worker in a session of its
own (accelerate's single-process launcher does not: its one process gets the Ctrl-C itself).
With `--max-restarts` above 0, torchrun restarts workers that exit non-zero, so a stop before a
save restarts them; the default is 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from eyas.errors import EyasError
from eyas.stage_cli import guarded

# The signals eyas takes over from the launcher, and the one it sends each worker in their place.
TAKEN = ("SIGTERM", "SIGINT")
WORKER_SIGNAL = signal.SIGTERM
# torch's default `--signals-to-handle` (torch/distributed/run.py); eyas removes TAKEN from it.
TORCH_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# How a worker that got WORKER_SIGNAL stops when it has nothing to checkpoint: eyas's handler for
# start-up and for stages without checkpoints (`eyas.stage_cli.stopped_by_sigterm`, 143), or killed by the signal
# itself before Python installed a handler.
STOPPED_BEFORE_SAVE = {128 + WORKER_SIGNAL, -WORKER_SIGNAL}

USAGE = ("usage: eyas launch torchrun [torchrun options] -m eyas.train RECIPE [section.key=value ...]\n"
         "       eyas launch accelerate launch [accelerate options] -m eyas.train RECIPE [section.key=value ...]\n\n"
         "Runs the launcher with its options unchanged; a SIGTERM or SIGINT asks every worker to save a\n"
         "checkpoint and exit, and the launch then ends with one line and exit status 0.")


class StoppedWithoutWorkers(BaseException):
    """SIGTERM/SIGINT while the launcher had no worker running (rendezvous, start-up). A
    BaseException, so the launcher's `except Exception` blocks let it pass; its `finally` blocks
    still stop whatever it started."""


def running_children() -> list[int]:
    """Pids of this process's live child processes: the launcher's workers (torchrun starts each
    with Popen, in a session of its own; accelerate's single-process launcher starts one)."""
    import psutil

    pids = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # it exited since the listing: not a worker to signal
            if child.status() != psutil.STATUS_ZOMBIE:
                pids.append(child.pid)
    return pids


class StopRequest:
    """Takes SIGTERM and SIGINT while the launcher runs and passes them on to its workers as SIGTERM."""

    def __init__(self, children: Callable[[], list[int]] = running_children) -> None:
        self.received: str | None = None
        self.signalled: set[int] = set()
        self._children = children
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for name in TAKEN:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name
        workers = self._children()
        if not workers and not self.signalled:
            raise StoppedWithoutWorkers(self.received)
        for pid in workers:  # a second signal is passed on again: harmless, the workers stop once
            with contextlib.suppress(ProcessLookupError):  # it exited since the listing: nothing to stop
                os.kill(pid, WORKER_SIGNAL)
                self.signalled.add(pid)

    @property
    def exit_status(self) -> int:
        """128 + the number of the signal received (the shell's convention for a process it ended)."""
        return 128 + getattr(signal, self.received or "SIGTERM")


def leave_signals_to_eyas() -> str:
    """Remove TAKEN from the signals torchrun handles by default (also under `accelerate launch`,
    which parses torchrun's options with torchrun's own parser): torchrun reads that default from
    PET_SIGNALS_TO_HANDLE when its parser is built. Returns the value set."""
    current = os.environ.get("PET_SIGNALS_TO_HANDLE", TORCH_DEFAULT_SIGNALS)
    kept = [name.strip() for name in current.split(",") if name.strip() and name.strip() not in TAKEN]
    os.environ["PET_SIGNALS_TO_HANDLE"] = ",".join(kept) or "SIGQUIT"
    return os.environ["PET_SIGNALS_TO_HANDLE"]


def run_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


def run_accelerate(argv: list[str]) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args(argv))


def pick_launcher(argv: list[str]) -> tuple[str, Callable[[list[str]], None], list[str]]:
    """(name, entry, the launcher's own arguments) for `torchrun ...` or `accelerate launch ...`."""
    if argv[:1] == ["torchrun"]:
        return "torchrun", run_torchrun, argv[1:]
    if argv[:2] == ["accelerate", "launch"]:
        return "accelerate launch", run_accelerate, argv[2:]
    given = " ".join(argv[:2]) or "nothing"
    raise EyasError(f"eyas launch runs 'torchrun ...' or 'accelerate launch ...', got '{given}'; "
                    "e.g. eyas launch torchrun --nproc_per_node 2 -m eyas.train RECIPE")


def stop_exit_codes(exc: BaseException) -> list[int] | None:
    """The workers' exit codes a launcher's failure reports (None: not a workers' failure)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        return [failure.exitcode for failure in exc.failures.values()]
    if isinstance(exc, subprocess.CalledProcessError):  # accelerate's single-process launcher
        return [exc.returncode]
    return None


def launch(argv: list[str]) -> int:
    """Run the launcher command `argv`; returns the exit status (see the module's docstring)."""
    name, entry, launcher_args = pick_launcher(argv)
    leave_signals_to_eyas()
    stop = StopRequest().install()
    saved_argv = sys.argv
    sys.argv = [name.split()[0]] + launcher_args  # as if the launcher had been started itself
    try:
        entry(launcher_args)
    except StoppedWithoutWorkers:
        print(f"eyas launch: stopped by {stop.received} before any worker ran; nothing to save, "
              "run the same command again to start", file=sys.stderr)
        return stop.exit_status
    except Exception as exc:
        codes = stop_exit_codes(exc) if stop.received else None
        if not codes or not set(codes) <= STOPPED_BEFORE_SAVE:
            raise  # the launcher's own report and exit status, as without eyas
        print(f"eyas launch: stopped by {stop.received}; the workers exited {codes[0]}, stopped before a save "
              "(while starting, or a stage that keeps its finished files), run the same command again to continue",
              file=sys.stderr)
        return stop.exit_status
    finally:
        sys.argv = saved_argv
        stop.restore()
    if stop.received:
        workers = len(stop.signalled)
        print(f"eyas launch: stopped by {stop.received}: the {workers} worker{'s' * (workers != 1)} saved their state "
              "and exited 0; run the same command again to resume", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    return guarded(lambda: launch(argv))


if __name__ == "__main__":
    sys.exit(main())
