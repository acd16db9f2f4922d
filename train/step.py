"""One optimizer step: `train.grad_accum` micro-batches through the unroll, the loss over the global batch,
backward, clipping, the optimizer and the schedule; and the step's metrics, read at log steps only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from eyas.errors import EyasError
from eyas.train import checkpoint as ckpt
from eyas.train.setup import Setup
from eyas.train.ttt import step_counts


@dataclass
class Totals:
    """Sums over the micro-batches of one optimizer step, or over one held-out pass (per unroll step k)."""

    loss: torch.Tensor          # [steps] loss sums (weighted by the loss mask)
    correct: torch.Tensor       # [steps] positions where the draft's argmax is the reference's
    counts: torch.Tensor        # [steps] loss-masked positions
    feature_loss: torch.Tensor  # [] EAGLE-1's feature regression sum
    tokens: torch.Tensor        # [] real (non-padding) tokens seen
    feature_scored: bool = False  # the kind has a feature loss (DraftHead.feature_loss_sum): report it

    @classmethod
    def zeros(cls, steps: int, device: Any) -> Totals:
        return cls(*(torch.zeros(n, device=device) for n in (steps, steps, steps)),
                   torch.zeros((), device=device), torch.zeros((), device=device))

    def add(self, out: dict, tokens: torch.Tensor | None = None) -> None:
        """Add one unroll's outputs (a `TrainingUnroll` forward)."""
        self.loss += torch.stack([s.detach().float() for s in out["loss_sums"]])
        self.correct += torch.stack([c.float() for c in out["correct"]])
        self.counts += torch.stack([c.float() for c in out["counts"]])
        if out["feature_loss_sum"] is not None:
            self.feature_loss += out["feature_loss_sum"].detach().float()
            self.feature_scored = True
        if tokens is not None:
            self.tokens += tokens

    def reduced(self, accelerator: Accelerator) -> Totals:
        """Summed over every process in one collective, on the CPU."""
        steps = self.loss.numel()
        packed = torch.cat([self.loss, self.correct, self.counts, self.feature_loss[None], self.tokens[None]])
        packed = accelerator.reduce(packed, reduction="sum").cpu()
        return Totals(packed[:steps], packed[steps:2 * steps], packed[2 * steps:3 * steps],
                      packed[3 * steps], packed[3 * steps + 1], self.feature_scored)


@dataclass
class StepSums:
    """One optimizer step's sums, left on the device: `step_metrics` reads them, at log steps only (a read
    is a host sync on a GPU, and a step that is not logged needs none but the finite check and the stop vote)."""

    totals: Totals              # this process's sums
    counts: torch.Tensor        # [steps] loss-masked positions over every process (the loss's denominators)
    grad_norm: Any              # the clipped gradient's norm (a tensor), or None without clipping
    lr: float
    steps: int                  # unroll depth of this step


def unroll_depth(setup: Setup, step: int) -> int:
    """Draft steps unrolled at optimizer step `step` (0-based): the full depth, or the ramp's.

    A function of the step alone, so a resumed run unrolls exactly as an uninterrupted one."""
    ramp, full = setup.cfg.ttt_ramp_steps, setup.train_steps
    if ramp <= 0 or full == 1:
        return full
    return min(full, 1 + step * full // ramp)


def train_step(setup: Setup, step: int, micro: list[tuple[dict, dict]]) -> StepSums:
    """Optimizer step `step` (0-based, the steps done before it) over `micro`: (batch, data position after it) pairs."""
    acc, cfg, device, steps = setup.accelerator, setup.cfg, setup.device, unroll_depth(setup, step)
    local = torch.zeros(steps, device=device)
    for batch, _ in micro:
        mask = batch["loss_mask"].float() * batch["attention_mask"].float()
        local += torch.stack(step_counts(mask, steps)).to(device)
    counts = acc.reduce(local, reduction="sum").clamp(min=1.0)
    scale = acc.num_processes * cfg.grad_accum  # undo DDP's mean over ranks and accelerate's / grad_accum
    totals = Totals.zeros(steps, device)
    losses = []  # each micro-batch's loss, kept on the device: read only if one is not finite
    for index, (batch, _) in enumerate(micro):
        batch = setup.source.prepare(batch, device)
        with acc.accumulate(setup.model):
            out = setup.model(batch, setup.teacher, steps, setup.mix, token_feed=setup.token_feed, feature_loss=True,
                              levers=setup.levers)
            loss = sum(w * s / c for w, s, c in zip(setup.weights, out["loss_sums"], counts)) * scale
            if out["feature_loss_sum"] is not None:
                loss = loss + cfg.feature_loss_weight * out["feature_loss_sum"] / counts[0] * scale
            losses.append(loss.detach())
            if index == len(micro) - 1:  # before the backward that may step (DeepSpeed steps inside it)
                check_finite(setup, step, torch.stack(losses), [position for _, position in micro])
            acc.backward(loss)
        totals.add(out, tokens=batch["attention_mask"].sum())
    grad_norm = None
    if cfg.max_grad_norm > 0:
        grad_norm = acc.clip_grad_norm_(setup.model.parameters(), cfg.max_grad_norm)
    lr = setup.scheduler.get_last_lr()[0]
    setup.optimizer.step()
    setup.scheduler.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return StepSums(totals, counts, grad_norm, lr, steps)


def check_finite(setup: Setup, step: int, losses: torch.Tensor, positions: list[dict]) -> None:
    """Stop before the optimizer step if any rank's loss of this step is not finite: one all-reduce and one
    read on the host per step, before the last micro-batch's backward (not one per micro-batch)."""
    bad = (~torch.isfinite(losses)).float()
    if float(setup.accelerator.reduce(bad.sum()[None], reduction="sum")) == 0:
        return
    last = ckpt.latest_checkpoint(setup.ckpt_root)
    index = int(bad.argmax()) if bad.any() else 0  # this rank's first bad micro-batch (another rank's: its first)
    position = positions[index]
    raise EyasError(
        f"non-finite loss at step {step + 1} (rank {setup.accelerator.process_index}: loss "
        f"{float(losses[index])}, micro-batch {index + 1}/{setup.cfg.grad_accum}, data epoch {position['epoch']} "
        f"batch {position['position']}); stopped before the optimizer step. Last good checkpoint: {last or 'none yet'}. "
        "Lower train.lr or check the shards (eyas.data.shard_verify.verify), then resume from it"
    )


def step_metrics(setup: Setup, sums: StepSums) -> dict:
    """The step's losses, accuracies, tokens and gradient norm over every process, read to the host (a collective)."""
    totals, counts, steps = sums.totals.reduced(setup.accelerator), sums.counts.cpu(), sums.steps
    grad_norm = sums.grad_norm
    metrics: dict = {"lr": sums.lr}
    if steps != setup.train_steps:
        metrics["ttt_depth"] = steps
    total = 0.0
    for k in range(steps):
        loss_k = float(totals.loss[k] / counts[k])
        metrics[f"loss_{k}"] = loss_k
        metrics[f"acc_{k}"] = float(totals.correct[k] / counts[k])
        total += setup.weights[k] * loss_k
    if totals.feature_scored:
        metrics["feature_loss"] = float(totals.feature_loss / counts[0])
        total += setup.cfg.feature_loss_weight * metrics["feature_loss"]
    metrics["loss"] = total
    metrics["tokens"] = int(totals.tokens)
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics
