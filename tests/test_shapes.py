"""The acceptance a draft shape is expected to give from per-depth rank rates (`eyas.shapes`), the figure
`train.select_shape` chooses `best/` by, and the per-rank counts the trainer's held-out eval feeds it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from eyas.shapes import parse_shape, ranks_needed, simulated_acceptance, simulated_acceptance_length
from eyas.train.ttt import _by_rank, _reference_rank

RATES = [[0.5, 0.2, 0.1, 0.05], [0.4, 0.25, 0.1, 0.05], [0.3, 0.2, 0.15, 0.1]]


def test_a_chain_is_the_chain_figure_up_to_the_unrolled_depth():
    first = [r[0] for r in RATES]
    assert simulated_acceptance(parse_shape("chain:3"), RATES) == pytest.approx(simulated_acceptance_length(first))
    assert simulated_acceptance(parse_shape("chain:2"), RATES) == pytest.approx(0.5 + 0.5 * 0.4)
    # deeper than the rates (the unroll's steps): not counted; a confidence cut only shortens the chain
    assert simulated_acceptance(parse_shape("chain:7"), RATES) == pytest.approx(simulated_acceptance_length(first))
    assert simulated_acceptance(parse_shape("chain:3,confidence=0.5"), RATES) == pytest.approx(0.76)
    assert ranks_needed(parse_shape("chain:3")) == 1


def test_a_static_tree_sums_its_paths():
    shape = parse_shape("tree:[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]")
    expected = 0.5 + 0.2 + 0.5 * 0.4 + 0.5 * 0.25 + 0.2 * 0.4 + 0.5 * 0.4 * 0.3
    assert simulated_acceptance(shape, RATES) == pytest.approx(expected)
    assert ranks_needed(shape) == 2


def _best_subtree(rates: list[list[float]], topk: int, nodes: int) -> float:
    """By brute force: the most valuable set of `nodes` rank paths closed under taking the parent."""
    paths = [p for d in range(1, len(rates) + 1) for p in itertools.product(range(topk), repeat=d)]
    value = {p: math.prod(rates[k][r] for k, r in enumerate(p)) for p in paths}
    best = 0.0
    for chosen in itertools.combinations(paths, nodes):
        kept = set(chosen)
        if all(len(p) == 1 or p[:-1] in kept for p in chosen):
            best = max(best, sum(value[p] for p in chosen))
    return best


@pytest.mark.parametrize("topk,nodes", [(2, 1), (2, 4), (2, 6), (3, 5)])
def test_a_dynamic_tree_is_the_best_tree_of_its_size(topk, nodes):
    shape = parse_shape(f"dynamic:depth=3,topk={topk},nodes={nodes}")
    assert simulated_acceptance(shape, RATES) == pytest.approx(_best_subtree(RATES, topk, nodes))
    assert ranks_needed(shape) == topk


def test_a_dynamic_tree_with_room_for_every_node_takes_the_whole_tree():
    shape = parse_shape("dynamic:depth=3,topk=4,nodes=200")
    held = [sum(r) for r in RATES]
    assert simulated_acceptance(shape, RATES) == pytest.approx(held[0] + held[0] * held[1] + held[0] * held[1] * held[2])


def test_positions_are_counted_by_the_target_tokens_rank_among_the_drafts():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 12, generator=generator)
    reference = torch.randint(0, 12, (2, 9), generator=generator)
    reference[0, 3] = -1  # outside the draft vocabulary: never ranked
    weight = (torch.rand(2, 9, generator=generator) > 0.3).float()
    counts = _by_rank(_reference_rank(logits, reference), weight, ranks=3)
    expected = torch.zeros(4)
    for b, t in itertools.product(range(2), range(9)):
        ref = int(reference[b, t])
        rank = 3 if ref < 0 else min(3, int((logits[b, t] > logits[b, t, ref]).sum()))
        expected[rank] += weight[b, t]
    assert torch.equal(counts, expected)
    assert float(counts[0]) == float(((logits.argmax(-1) == reference).float() * weight).sum())


def test_a_tied_reference_ranks_as_argmax_breaks_the_tie():
    """bf16 logits tie often: rank 0 is exactly the positions where the draft's argmax is the reference, so the
    rank-0 rate a tree figure reads equals the accuracy the chain figure reads, in any precision."""
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]]]).to(torch.bfloat16)
    reference = torch.tensor([[2, 0]])
    assert _reference_rank(logits, reference).tolist() == [[1, 0]]  # token 1 wins the tie at slot 0
    generator = torch.Generator().manual_seed(1)
    rounded = (torch.randn(3, 40, 16, generator=generator) * 2).round().to(torch.bfloat16)  # many ties
    reference = torch.randint(0, 16, (3, 40), generator=generator)
    rank = _reference_rank(rounded, reference)
    assert torch.equal(rank == 0, rounded.argmax(-1) == reference)
