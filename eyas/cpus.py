"""The CPUs this process may run on, and the compute threads each of the processes sharing them gets.

`os.cpu_count()` counts the machine's CPUs, but a process runs only where its affinity mask lets it:
a SLURM task's cpuset, a container pinned to some cores, `taskset -c 1` (CI runs each of its two
test lanes on one core of its own). torch's default thread count follows the mask; a count computed
from `os.cpu_count()` does not, and its extra threads wait on each other in OpenMP spin loops: two
processes of 2 threads each on a 2-core machine ran a training-sized matmul loop at 62% of the
machine's throughput, two of one thread each pinned to a core at 98% (docs/stages.md, "Tests").
"""

from __future__ import annotations

import os


def allowed_cpus() -> list[int]:
    """The ids of the CPUs in this process's affinity mask, ascending (all of them where the platform has no mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return list(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(allowed_cpus())


def threads_per_process(processes: int = 1) -> int:
    """Compute threads for each of `processes` processes sharing this process's CPUs (at least one)."""
    return max(1, available_cpus() // max(1, processes))
