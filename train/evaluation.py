"""The held-out evaluation: per-step loss and accuracy against the target's argmax, simulated acceptance of the
chain and of the shape `best/` is chosen for (`train.select_shape`), on the same batches whatever the number of
processes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from eyas.data.batches import budget_batches
from eyas.errors import EyasError
from eyas.shapes import simulated_acceptance, simulated_acceptance_length
from eyas.train.loader import read_batch
from eyas.train.losses import Teacher
from eyas.train.setup import Setup
from eyas.train.step import Totals
from eyas.train.ttt import TreeLevers


@torch.no_grad()
def evaluate(setup: Setup) -> dict:
    """Per-step loss and accuracy (against the target's full-vocab argmax) and simulated acceptance."""
    steps, model, device = setup.eval_steps, setup.model, setup.device
    reader = setup.source.heldout_reader or setup.source.train_reader
    mine, rounds, spare = eval_batches(setup, reader)
    totals = Totals.zeros(steps, device)
    width = setup.select_width
    chain = TreeLevers(setup.levers.width)  # the draft's own path (its first choices): the chain's figures, the cover
    by_rank = torch.zeros(steps, width + 1, device=device)
    cover = torch.zeros(steps, device=device)
    model.eval()
    for index in range(rounds):
        # Every rank runs the same number of forwards (FSDP/ZeRO-3 gather weights collectively);
        # a rank short of batches repeats one and discards the result.
        real = index < len(mine)
        batch = setup.source.prepare(read_batch(reader, mine[index] if real else spare), device)
        reference = reference_argmax(setup.teacher, batch)
        out = model(batch, setup.teacher, steps, setup.mix, token_feed=setup.token_feed,
                    teacher_top=reference, ranks=width, levers=chain)
        ranked = out if setup.eval_tree is None else model(
            batch, setup.teacher, steps, setup.mix, token_feed=setup.token_feed, teacher_top=reference, ranks=width,
            levers=setup.eval_tree)
        if real:
            totals.add(out)
            cover += torch.stack(out["cover_sums"])
            by_rank += torch.stack(ranked["rank_counts"])
    model.train()
    totals = totals.reduced(setup.accelerator)
    by_rank, cover = (setup.accelerator.reduce(t, reduction="sum").cpu() for t in (by_rank, cover))
    return _metrics(setup, totals, by_rank, cover)


def _metrics(setup: Setup, totals: Totals, by_rank: torch.Tensor, cover: torch.Tensor) -> dict:
    """The figures of one held-out pass from its sums over every process (on the CPU)."""
    steps, width = setup.eval_steps, setup.select_width
    counts = totals.counts.clamp(min=1.0)
    accuracy = [float(totals.correct[k] / counts[k]) for k in range(steps)]
    metrics = {f"acc_{k}": a for k, a in enumerate(accuracy)}
    metrics.update({f"loss_{k}": float(totals.loss[k] / counts[k]) for k in range(steps)})
    metrics["sim_accept"] = simulated_acceptance_length(accuracy)
    reach = by_rank.sum(-1)  # per depth, the positions a tree's branch reached (a chain's: every one)
    rank_rates = [[float(by_rank[k, r] / reach[k].clamp(min=1.0)) for r in range(width)] for k in range(steps)]
    if setup.eval_tree is not None:
        metrics.update({f"reach_{k}": float(reach[k] / counts[k]) for k in range(steps)})
    metrics["select_shape"] = setup.select.spec
    metrics["select_accept"] = simulated_acceptance(setup.select, rank_rates)
    metrics.update({f"rank_rate_{k}_{r}": rate for k, rates in enumerate(rank_rates) for r, rate in enumerate(rates)})
    metrics.update({f"cover_{k}": float(cover[k] / counts[k]) for k in range(steps)})
    metrics["cover_width"] = setup.levers.width
    metrics["positions"] = int(totals.counts.sum())
    metrics["split"] = "heldout" if setup.source.heldout_reader is not None else "train-slice"
    return metrics


def eval_batches(setup: Setup, reader: Any) -> tuple[list, int, Any]:
    """This rank's share of the first `train.eval_batches` batches (longest first, unshuffled).

    The same global batches whatever the number of processes, so held-out figures of a
    1-process and an N-process run agree; returns (this rank's index arrays, rounds, a spare
    batch for ranks with fewer).
    """
    lengths = reader.lengths
    order = np.argsort(-lengths, kind="stable")
    batches = budget_batches(order, lengths, setup.cfg.token_budget)[: setup.cfg.eval_batches]
    if not batches:
        raise EyasError("the held-out data is empty; dump a held-out split (data.heldout_fraction > 0)")
    world, rank = setup.accelerator.num_processes, setup.accelerator.process_index
    return batches[rank::world], math.ceil(len(batches) / world), batches[0]


def reference_argmax(teacher: Teacher, batch: dict) -> torch.Tensor:
    """What greedy verification accepts: the target's argmax over its full vocabulary, as draft ids."""
    if "last_hidden" in batch:
        return teacher.full_argmax_in_draft(batch["last_hidden"])
    return teacher.to_draft_ids(batch["topk_ids"][..., 0].long())
