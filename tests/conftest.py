"""Shared pytest fixtures: tiny targets (session-scoped) and the real SmolLM2 target."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Checkpoints are signed with a per-user key (eyas.train.trust); tests, and the processes they
# launch, use a key of their own instead of creating or reading the user's.
os.environ.setdefault("EYAS_CHECKPOINT_KEY_FILE", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"eyas-test-key-{os.getpid()}"))


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (the README's `pytest -n auto`), each worker runs on one CPU of its own.

    Its processes (and the subprocesses and vLLM engines its tests start) count one CPU (eyas.cpus) and start
    one compute thread, so the workers never wait on each other's OpenMP threads: unpinned, two processes of
    two threads each on 2 cores ran at 62% of the machine's throughput, pinned at 98% (docs/stages.md, "Tests").
    Done before torch is imported, so its thread pool is sized by the pinned mask. A lone
    worker keeps every CPU; more workers than CPUs are left to the operating system."""
    from eyas.cpus import allowed_cpus  # os alone: torch is not imported yet

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    cpus = allowed_cpus() if hasattr(os, "sched_setaffinity") else []
    if not worker or not 2 <= int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= len(cpus):
        return
    cpu = cpus[int(worker.removeprefix("gw")) % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)  # vLLM binds its engine's threads to this CPU too


_pin_xdist_worker()

from fixtures import build_tiny_target  # noqa: E402

# Test modules whose tests take longest, started first: with `-n auto --dist loadfile` whole modules go to the
# workers in this order (pyproject's addopts keep xdist from reordering them by test count), so the other
# worker runs the many short modules beside them instead of waiting at the end. The vLLM parity module
# prepares through `vllm serve`, dumps, trains and serves (about 6 minutes on a 2-core AVX2-only EPYC); then
# every module with a test marked slow (the real SmolLM2 target) or a T>0 distribution check.
LONGEST_FIRST = ("test_vllm_parity.py", "test_eval_batched.py", "test_eval_slow.py", "test_data_e2e.py",
                 "test_data_dump.py", "test_dspark.py", "test_eval_sampled_targets.py", "test_eval_exact.py",
                 "test_eval_exact_filters.py", "test_eval_exact_tree.py", "test_eval_acceptance.py",
                 "test_eval_greedy.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama-shaped target (6 layers, hidden 64, vocab 384) saved with save_pretrained."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2-shaped target (attention biases, untied head) saved with save_pretrained."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE-shaped target (4 experts, 2 per token, in all 6 layers; heads of 32)."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def parity_drafts(tmp_path_factory) -> dict:
    """The real-data eagle3 draft the vLLM tests serve, trained once per session (`tests/test_vllm_parity.py`);
    the other drafts served train on the same prepared data and shards when a test first serves them.
    EYAS_PARITY_RUN_DIR keeps (and reuses) them between runs: CI points every tier at one folder."""
    from test_vllm_parity import train_parity_drafts

    keep = os.environ.get("EYAS_PARITY_RUN_DIR")
    return train_parity_drafts(Path(keep) if keep else tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="session")
def served(parity_drafts, tmp_path_factory):
    """(dtype, front) -> the vLLM parity measurement of every draft `tests/test_vllm_parity.py` serves at that
    dtype in the front (FRONT) or the `serving` tier (SERVED), made once per session: the mtp test reads the
    same fp32 measurement as the other serving rows."""
    from test_vllm_parity import FRONT, SERVED, measure_served

    measured: dict[tuple[str, bool], dict] = {}

    def at(dtype: str, front: bool = False) -> dict:
        if (dtype, front) not in measured:
            out = tmp_path_factory.mktemp(f"vllm-{dtype}{'-front' if front else ''}")
            measured[dtype, front] = measure_served(parity_drafts, dtype, out, FRONT if front else SERVED)
        return measured[dtype, front]
    return at


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the user cache (slow tests only)."""
    from eyas.targets import SMOLLM2_ALIAS, resolve_target_path

    return resolve_target_path(SMOLLM2_ALIAS)
