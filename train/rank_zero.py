"""Work only the main process does, bounded by train.dist_timeout_s while the other ranks wait for it.

Rank 0 alone signs, publishes and prunes checkpoints, converts a DeepSpeed state for another number
of processes and hashes a state before a resume, on what may be a slow shared filesystem. The other
ranks wait in a collective meanwhile; in NCCL's that wait is bounded by its watchdog, which kills
the job with a timeout that names no cause. Here they wait instead in a broadcast of rank 0's outcome
over a gloo group of their own, with train.dist_timeout_s as its timeout, so that:
- a slow rank-0 step stops every rank with an error that names the step, the time and the setting;
- an error on rank 0 reaches the others at once instead of leaving them waiting;
- each step's time on rank 0 is measured, reported when it takes more than half the bound, and kept
  (`RankZeroWork.seconds`, the longest of each step) for the run's summary.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from eyas.errors import EyasError

T = TypeVar("T")
SETTING = "train.dist_timeout_s"


class RankZeroWork:
    """`run(what, fn)`: fn on the main process, its result on every rank, within `timeout_s` seconds."""

    def __init__(self, accelerator: Any, timeout_s: float) -> None:
        self.accelerator, self.timeout_s = accelerator, float(timeout_s)
        self.seconds: dict[str, float] = {}
        self._group = None
        if accelerator.num_processes > 1:  # a collective: every rank builds it, here, at the same point
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """fn() on the main process; every rank returns its value (it must pickle) or raises its error."""
        if self._group is None:
            return self._timed(what, fn)
        outcome: list[Any] = [None, None]  # [value, the main process's error message]
        failure: BaseException | None = None
        if self.accelerator.is_main_process:
            try:
                outcome[0] = self._timed(what, fn)
            except BaseException as exc:  # never leave the other ranks waiting for a verdict that is not coming
                failure, outcome[1] = exc, f"{type(exc).__name__}: {exc}"
        self._share(what, outcome)
        if outcome[1] is None:
            return outcome[0]
        self._all_heard()
        if failure is not None:
            raise failure
        raise EyasError(f"the main process failed in the {what} (its own error says more): {outcome[1]}")

    def _timed(self, what: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return fn()
        finally:
            took = time.monotonic() - start
            self.seconds[what] = max(took, self.seconds.get(what, 0.0))
            if took > self.timeout_s / 2:
                print(f"eyas train: the {what} took {took:.0f} s on the main process, more than half of "
                      f"{SETTING}={self.timeout_s:g}; on a slower day it stops the run: raise {SETTING}", flush=True)

    def _all_heard(self) -> None:
        """Every rank holds the main process's error before any rank raises it: the main process's exit ends the
        launch (the launcher stops the other ranks), and a rank still reading the broadcast then would report a
        broken connection instead of the cause."""
        # a rank that already stopped makes the barrier fail: the error raised next is still the one to report
        with contextlib.suppress(RuntimeError):
            dist.barrier(group=self._group)

    def _share(self, what: str, outcome: list[Any]) -> None:
        try:
            dist.broadcast_object_list(outcome, src=0, group=self._group)
        except RuntimeError as exc:  # gloo's timeout, or a peer that already stopped for it
            rank = self.accelerator.process_index
            who = "the main process" if rank == 0 else f"rank {rank}"
            took = f" (it took {self.seconds[what]:.0f} s)" if what in self.seconds else ""
            raise EyasError(f"{who} stopped: the main process's {what} did not finish within {SETTING}="
                            f"{self.timeout_s:g} s{took}. A slow or busy filesystem under the run directory is the "
                            f"usual cause; raise {SETTING} (gloo said: {str(exc).splitlines()[0][:200]})") from None
