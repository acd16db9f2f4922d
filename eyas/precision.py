"""Precision chosen by the machine: bf16 only where the hardware runs it natively.

On a GPU with bf16 (Ampere and later) bf16 autocast and bf16 weights are the fast choice. On a
CPU it depends: with AMX (`amx_bf16`) or AVX512-BF16 (`avx512_bf16`) oneDNN runs bf16 matmuls
natively and bf16 is faster; without them every bf16 operation is emulated and measured 2-4.5x
slower than fp32 (issue 15: one bf16 matmul 4.5x, training steps 2-3.5x, generation about 2x).
So `auto` means bf16 only where it is native:

- `native_bf16(device)`: CUDA: `torch.cuda.is_bf16_supported()`; CPU: the flags in
  /proc/cpuinfo (x86 `amx_bf16`/`avx512_bf16`, Arm `bf16`); where the flags cannot be read, one
  small matmul timed each way (`bf16_ratio`) decides. Each answer is computed once per process.
- `mixed_precision_for(setting, device)`: the accelerate `mixed_precision` value for
  `train.mixed_precision` (auto -> bf16 or no).
- `regenerate_dtype(setting, target_dtype, device)`: the weights dtype for
  `data.regenerate_dtype` (auto -> bfloat16 or float32/float16; empty -> target.dtype).
- `eyas eval`'s target precision (`eval.target_dtype`) is decided by measuring, since bf16 must
  also be exact for a T=0 eval: `eyas.eval.target_precision`.

A recipe that forces bf16 on a CPU without native bf16 is obeyed, with one warning line on
stderr giving the measured slowdown and the setting to change.

`EYAS_CPU_BF16=native` (or `=emulated`) sets the CPU's answer instead of its flags: what `auto`
picks on an AVX512-BF16 or AMX machine (or on an AVX2-only one) can then be run on any CPU, at the
emulated speed where bf16 is not native. CI runs the train and eval tests once so (`.ci/run`), and
a test that compares two evaluations must hold in whichever precision `auto` picks.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

CPUINFO = Path("/proc/cpuinfo")
X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Set to `native` or `emulated`: the CPU's bf16 answer, whatever its flags say (the module docstring).
CPU_BF16_ENV = "EYAS_CPU_BF16"
CPU_BF16_SETTINGS = {"native": True, "emulated": False}
_warned: set[str] = set()


def _device_type(device: Any = None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type if not hasattr(device, "type") else device.type


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str] | None:
    """The CPU's feature flags (x86 `flags`, Arm `Features`), None where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags or None


def cpu_bf16_from_flags(flags: set[str]) -> bool:
    """True when the flags show native bf16 matmuls (x86 AMX / AVX512-BF16, Arm BF16)."""
    return any(f in flags for f in X86_BF16_FLAGS) or "bf16" in flags


@functools.cache
def bf16_ratio(size: int = 256, repeats: int = 5) -> float:
    """Time of one [size x size] bf16 matmul over the fp32 one on this CPU (best of `repeats`).

    Above 1: bf16 is slower here. Measured once per process (about 10-50 ms)."""
    import torch

    def best(dtype: Any) -> float:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.matmul(a, b)  # warm-up: kernel selection, allocation
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    fp32 = best(torch.float32)
    return best(torch.bfloat16) / max(fp32, 1e-9)


@functools.cache
def _cpu_native() -> bool:
    setting = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if setting:
        if setting not in CPU_BF16_SETTINGS:
            raise EyasError(f"{CPU_BF16_ENV}={setting!r} is not one of {', '.join(CPU_BF16_SETTINGS)}; "
                            f"unset it to let the CPU's flags decide")
        return CPU_BF16_SETTINGS[setting]
    flags = cpu_flags()
    if flags is not None:
        return cpu_bf16_from_flags(flags)
    return bf16_ratio() < 1.0


def native_bf16(device: Any = None) -> bool:
    """Whether bf16 runs natively (and so faster than fp32) on `device` (default: cuda if any, else cpu)."""
    kind = _device_type(device)
    if kind == "cuda":
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if kind == "cpu":
        return _cpu_native()
    return False


def warn_slow_bf16(key: str, value: str, device: Any = None) -> bool:
    """One warning line (once per key and process) when `key: value` forces bf16 on a CPU without it.

    Returns True when it warned."""
    if _device_type(device) != "cpu" or native_bf16("cpu") or key in _warned:
        return False
    _warned.add(key)
    ratio = bf16_ratio()
    print(f"eyas: warning: {key}: {value} on a CPU without native bf16 (no AMX, no AVX512-BF16): a bf16 matmul "
          f"takes {ratio:.1f}x the fp32 time here; set {key}: auto to use fp32 on this machine",
          file=sys.stderr, flush=True)
    return True


def mixed_precision_for(setting: str, device: Any = None) -> str:
    """accelerate's `mixed_precision` for `train.mixed_precision`: auto = bf16 where native, else no."""
    if setting in ("no", "fp32"):
        return "no"
    if setting == "auto":
        return "bf16" if native_bf16(device) else "no"
    if setting == "bf16":
        warn_slow_bf16("train.mixed_precision", setting, device)
    return setting


def regenerate_dtype(setting: str, target_dtype: str, device: Any = None) -> str:
    """The weights dtype the target regenerates with, as a `target.dtype` value.

    '' -> target.dtype; auto -> bfloat16 where native, else float32 on a CPU (float16 on a GPU
    without bf16); bfloat16 on a CPU without native bf16 is kept, with one warning line."""
    if not setting:
        return target_dtype
    if setting == "auto":
        if native_bf16(device):
            return "bfloat16"
        return "float16" if _device_type(device) == "cuda" else "float32"
    if setting == "bfloat16":
        warn_slow_bf16("data.regenerate_dtype", setting, device)
    return setting
