"""The glue of benchmarks/bench_peer_speculators.py that needs neither speculators nor vLLM: the
batch order it hands the peer, the loss-mask shift, and the acceptance figures from vLLM's counters."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas.train.loader import TokenBudgetLoader
from eyas.train.ttt import step_counts

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # its `from machine import ...`
    try:
        spec = importlib.util.spec_from_file_location("bench_peer_speculators", BENCH / "bench_peer_speculators.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


class _Lengths:
    """What TokenBudgetLoader reads to plan batches: the sample lengths."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.lengths)


def test_order_is_eyas_loader_batches_per_epoch(bench):
    reader = _Lengths([int(n) for n in np.random.default_rng(0).integers(5, 300, size=97)])
    order = bench.EyasOrder(TokenBudgetLoader(reader, 2048, seed=3))
    reference = TokenBudgetLoader(reader, 2048, seed=3)
    for epoch in (0, 1, 2):
        order.set_epoch(epoch)
        reference.set_epoch(epoch)
        got = list(order)
        assert got == [[int(i) for i in b] for b in reference._rank_batches()]
        assert len(order) == len(got)
        assert sorted(i for b in got for i in b) == list(range(len(reader)))
        assert all(max(reader.lengths[b]) * len(b) <= 2048 for b in got)
    order.set_epoch(0)
    first = list(order)
    order.set_epoch(1)
    assert list(order) != first  # shuffled per epoch, as eyas trains


def test_peer_mask_counts_the_positions_eyas_counts(bench):
    """After speculators' shift (drop token 0) step k reads mask[k:]; that is eyas's mask[k+2:]."""
    mask = (torch.rand(57, generator=torch.Generator().manual_seed(1)) > 0.4).float()
    peer = bench.peer_loss_mask(mask)
    assert peer.dtype == torch.bool and peer.shape == mask.shape and not peer[-1]
    shifted = peer[1:].float()
    eyas = [float(c) for c in step_counts(mask[None], 3)]
    assert [float(shifted[k:].sum()) for k in range(3)] == eyas


def test_figures_from_vllm_counters(bench):
    groups = [{"drafts": 10, "draft_tokens": 30, "accepted": 12, "accepted_per_pos": [6, 4, 2], "tokens": 40,
               "seconds": 2.0, "outputs": [[1], [2]]},
              {"drafts": 10, "draft_tokens": 30, "accepted": 3, "accepted_per_pos": [2, 1, 0], "tokens": 20,
               "seconds": 1.0, "outputs": [[3]]}]
    total = bench.summed(groups)
    assert total["accepted_per_pos"] == [8, 5, 2] and total["drafts"] == 20 and total["prompts"] == 3
    fig = bench.figures(total)
    assert fig["mean_acceptance_length"] == pytest.approx(1 + 15 / 20)
    assert fig["acceptance_per_position"] == pytest.approx([0.4, 0.25, 0.1])
    assert fig["alpha"] == pytest.approx([0.4, 5 / 8, 2 / 5])
    assert bench.figures({"drafts": 0, "accepted": 0, "accepted_per_pos": [], "tokens": 0})["mean_acceptance_length"] == 1.0
