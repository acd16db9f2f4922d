"""What a benchmark ran on, recorded in every results JSON: the machine (with its load, since
timings here are ratios taken on a shared machine) and the versions of the libraries measured."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata


def machine() -> dict:
    import torch

    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
            "bf16_matmul": [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]}


def versions(*packages: str) -> dict:
    """Python and the given distributions (absent ones as None)."""
    found = {"python": sys.version.split()[0]}
    for name in ("torch", *packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
