"""RankZeroWork: what the main process does alone is measured, bounded by train.dist_timeout_s, and its
outcome (a value or an error) reaches every rank. One process here; two in tests/test_train_distributed.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from eyas.train.rank_zero import RankZeroWork


class OneProcess:
    is_main_process, num_processes, process_index = True, 1, 0


def test_one_process_measures_and_returns():
    work = RankZeroWork(OneProcess(), timeout_s=60)
    assert work.run("sum", lambda: sum(range(10))) == 45
    work.run("sum", lambda: time.sleep(0.05))
    assert work.seconds["sum"] >= 0.05  # the longest of the step's runs


def test_a_step_over_half_the_bound_is_reported(capsys):
    work = RankZeroWork(OneProcess(), timeout_s=0.1)
    work.run("checkpoint's signing and publishing", lambda: time.sleep(0.06))
    out = capsys.readouterr().out
    assert "checkpoint's signing and publishing took" in out and "raise train.dist_timeout_s" in out


def test_the_main_process_error_is_its_own():
    work = RankZeroWork(OneProcess(), timeout_s=60)
    with pytest.raises(OSError, match="disk full"):
        work.run("draft's save", lambda: (_ for _ in ()).throw(OSError("disk full")))
    assert "draft's save" in work.seconds  # measured although it failed


TWO_RANKS = textwrap.dedent('''
    import os, sys, time
    import torch.distributed as dist
    from eyas.errors import EyasError
    from eyas.train.rank_zero import RankZeroWork

    class Ranks:
        num_processes = 2
        process_index = int(os.environ["RANK"])
        is_main_process = process_index == 0

    def say(*words):  # one write per line: both ranks share the launcher's unbuffered stdout
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())

    dist.init_process_group("gloo")
    work = RankZeroWork(Ranks(), timeout_s=float(sys.argv[1]))
    say("value", Ranks.process_index, work.run("count", lambda: (time.sleep(1), 7)[1]))
    try:
        work.run("draft's save", lambda: (_ for _ in ()).throw(OSError("disk full")))
    except (EyasError, OSError) as exc:
        say("error", Ranks.process_index, type(exc).__name__, exc)
    dist.barrier()
    try:
        work.run("publish", lambda: time.sleep(3 * float(sys.argv[1])))
    except EyasError as exc:
        say("bounded", Ranks.process_index, exc)
        os._exit(3)
''')


@pytest.mark.slow
@pytest.mark.cluster
def test_two_ranks_share_the_value_the_error_and_the_bound(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    # the bound is 8x the 1 s step that must pass it: two ranks time-sliced on one loaded core (a CI lane) start
    # their waits up to seconds apart
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), "8"],
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert "value 0 7" in out and "value 1 7" in out  # the main process's result on both ranks
    assert "error 0 OSError disk full" in out  # the main process raises its own error ...
    assert "error 1 EyasError the main process failed in the draft's save" in out  # ... and rank 1 hears of it
    assert "bounded 1 rank 1 stopped: the main process's publish did not finish within train.dist_timeout_s=8" in out
    assert proc.returncode != 0
