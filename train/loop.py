"""`eyas train RECIPE`: fit a draft head on shards (or online) with accelerate.

The same code runs as `eyas train RECIPE`, `python -m eyas.train RECIPE`,
`torchrun --nproc_per_node N -m eyas.train RECIPE` and
`accelerate launch --config_file recipes/accelerate/<ddp|fsdp|deepspeed_zero2|deepspeed_zero3>.yaml -m eyas.train RECIPE`:
the distributed setup (DDP, FSDP, DeepSpeed ZeRO-2/3) comes from the launcher's environment,
`Accelerator(cpu=True)` on a machine without a GPU.

One optimizer step = `train.grad_accum` micro-batches of `train.token_budget` tokens on every
process. The loss of step k of the unroll is a mean over the loss-masked positions of the
whole global batch (all micro-batches, all processes), so N processes x 1 micro-batch and
1 process x N micro-batches compute the same update; the unrolled steps are summed with
weights `train.ttt_decay ** k`.

Checkpoints (`run_dir/checkpoints/step_NNNNNNNN/`, see `eyas.train.checkpoint`) every
`train.save_every` steps and at the end; the last `train.keep_last` are kept, and
`checkpoints/best/` holds the draft with the best held-out simulated acceptance length
(sum over k of the product of per-step accuracies up to k). A run resumes from its newest
checkpoint (`train.resume`): weights, optimizer, scheduler, step, data position and RNG of
every rank, so a run killed at step N and resumed ends with the weights of an
uninterrupted one.

Signals: SIGTERM or SIGUSR1 (SLURM preemption) make every rank finish the current optimizer
step, save a checkpoint and exit with status 0; the next launch resumes from it. A NaN or
inf loss stops the run (exit status 2) naming the step, the batch and the last good checkpoint.

The pieces: `eyas.train.setup` builds what a run is made of (accelerator, data source, head, teacher, loader,
optimizer, schedule), `eyas.train.step` runs one optimizer step, `eyas.train.evaluation` the held-out eval,
`eyas.train.save` and `eyas.train.resume` write and read the checkpoints; `Trainer` here runs the loop over them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from eyas import stages
from eyas.config import save_resolved
from eyas.draft.checkpoint import save_draft
from eyas.io import publish_dir
from eyas.recipe_schema import Recipe
from eyas.stage_cli import stage_main
from eyas.train import checkpoint as ckpt
from eyas.train.evaluation import evaluate
from eyas.train.loader import BatchStream, TokenBudgetLoader, make_loader
from eyas.train.memory import refuse_if_too_big
from eyas.train.metrics import MetricsLogger
from eyas.train.resume import Resumed, resume, resume_notes
from eyas.train.save import save_checkpoint
from eyas.train.setup import Setup, set_up
from eyas.train.state import TrainState
from eyas.train.step import StepSums, step_metrics, train_step

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopSignals:
    """Records SIGTERM/SIGUSR1 instead of dying; the loop checkpoints and exits at a step boundary."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class Trainer:
    """One run: the parts `set_up` built (`setup`), its progress (`state`), and `run()`, which trains to the end,
    a signal, or `stop_at_step`."""

    def __init__(self, recipe: Recipe, target_model: Any = None) -> None:
        # refuse_if_too_big (here), save_draft and publish_dir (`save`) are passed as this module's names,
        # which the tests replace (the fit check on a CPU, a full disk, a slow filesystem)
        self.setup: Setup = set_up(recipe, target_model, fit_check=refuse_if_too_big)
        self.state = TrainState()
        self.position: dict = {}  # the data position after the last step, which a checkpoint saves
        self.unread_tokens = torch.zeros((), dtype=torch.long, device=self.setup.device)  # of the steps since their last read
        self.resumed: Resumed | None = None

    def make_loader(self, reader: Any, shuffle: bool) -> TokenBudgetLoader:
        return make_loader(self.setup.recipe, self.setup.accelerator, reader, shuffle)

    def train_step(self, micro: list[tuple[dict, dict]]) -> StepSums:
        return train_step(self.setup, self.state.step, micro)

    def step_metrics(self, sums: StepSums) -> dict:
        return step_metrics(self.setup, sums)

    def evaluate(self) -> dict:
        return evaluate(self.setup)

    def resume(self) -> None:
        """Restore everything from the newest complete checkpoint, if resuming is on and there is one."""
        self.resumed = resume(self.setup)
        if self.resumed:
            self.state, self.position = self.resumed.state, self.resumed.position

    def save(self, best_only: bool = False) -> Path:
        return save_checkpoint(self.setup, self.state, self.position, best_only, write_draft=save_draft, publish=publish_dir)

    # -- the loop

    def run(self, stop_at_step: int | None = None) -> dict:
        s, cfg = self.setup, self.setup.cfg
        self.position = s.loader.state_dict()
        self.resume()
        if s.accelerator.is_main_process:
            save_resolved(s.recipe, s.ckpt_root)
        logger = MetricsLogger(s.accelerator, s.recipe, s.total_steps, self.state.step)
        logger.message(self._first_line())
        if self.resumed:
            for note in resume_notes(s, self.resumed):
                logger.message(f"eyas train: {note}")
        signals = StopSignals().install()
        stream = BatchStream(s.loader, cfg.prefetch, cfg.loader_workers, decode_in_reader=s.device.type == "cpu")
        try:
            outcome = self._train(stream, logger, signals, stop_at_step)
        finally:
            stream.close()
            signals.restore()
            logger.close()
            s.source.close(trained=stream.taken)
        return {"step": self.state.step, "outcome": outcome, "checkpoint": ckpt.latest_checkpoint(s.ckpt_root),
                "best": ckpt.best_checkpoint(s.run_dir), "best_score": self.state.best_score,
                "best_by": self.state.best_by,
                "last_eval": self.state.last_eval, "main_process_seconds": dict(s.rank_zero.seconds)}

    def _first_line(self) -> str:
        s, cfg, acc = self.setup, self.setup.cfg, self.setup.accelerator
        trainable, total = s.param_counts
        return (f"eyas train: {s.kind} head ({trainable:,} trainable of {total:,} parameters), "
                f"{s.total_steps} steps of {acc.num_processes} x {cfg.grad_accum} x {cfg.token_budget} tokens, "
                f"TTT {s.train_steps} step(s)"
                + (f" (ramped from 1 over {cfg.ttt_ramp_steps} steps)" if cfg.ttt_ramp_steps and s.train_steps > 1 else "")
                + f"; {s.init_note}; {s.source.description}; device {s.device}, "
                f"mixed precision {acc.mixed_precision}"
                + (f"; resumed from {self.resumed.checkpoint} (step {self.state.step})" if self.resumed else ""))

    def _train(self, stream: BatchStream, logger: MetricsLogger, signals: StopSignals, stop_at_step: int | None) -> str:
        """Optimizer steps to the end, or to a stop (a signal or `stop_at_step`) after its checkpoint; the outcome."""
        cfg, total_steps = self.setup.cfg, self.setup.total_steps
        while self.state.step < total_steps:
            micro = [next(stream) for _ in range(cfg.grad_accum)]
            done = self.train_step(micro)
            self.position = micro[-1][1]
            self.state.step += 1
            self.unread_tokens += done.totals.tokens.long()  # this process's, on the device until the next read
            logger.advance(1)
            step = self.state.step
            last = step == total_steps
            logged = step % cfg.log_every == 0 or last
            if logged:  # the only reads of the step's sums
                metrics = self.step_metrics(done)
                self._count_tokens(logger)
                logger.log(step, {**metrics, **logger.rates()})
            if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                self._evaluate_and_keep_best(logger)
            stop = self._stop_requested(signals, stop_at_step)
            if (cfg.save_every and step % cfg.save_every == 0) or last or stop:
                if not logged:
                    self._count_tokens(logger)  # the checkpoint's token count is exact
                path = self.save()
                if stop:
                    outcome = signals.received or "stop_at_step"
                    logger.message(f"eyas train: {outcome} at step {step}: saved {path}; exiting "
                                   "(run the same command again to resume)")
                    return outcome
        return "done"

    def _count_tokens(self, logger: Any) -> None:
        """Add the tokens of the steps since the last read (every process's: a collective) to the state and the rates."""
        tokens = int(self.setup.accelerator.reduce(self.unread_tokens[None], reduction="sum"))
        self.unread_tokens.zero_()
        self.state.tokens += tokens
        logger.advance(0, tokens)

    def _stop_requested(self, signals: StopSignals, stop_at_step: int | None) -> bool:
        """Every rank agrees: a signal on any rank (or the requested step) stops all of them."""
        local = 1.0 if signals.received or (stop_at_step is not None and self.state.step >= stop_at_step) else 0.0
        flag = self.setup.accelerator.reduce(torch.tensor([local], device=self.setup.device), reduction="sum")
        if float(flag) > 0 and signals.received is None and stop_at_step is None:
            signals.received = "signal on another rank"
        return float(flag) > 0

    def _evaluate_and_keep_best(self, logger: Any) -> None:
        metrics, select = self.evaluate(), self.setup.select
        self.state.last_eval = {**metrics, "step": self.state.step}
        logger.log(self.state.step, metrics, kind="eval")
        logger.message(f"eyas train: step {self.state.step} held-out ({metrics['split']}): simulated acceptance "
                       f"{metrics['sim_accept']:.3f} (chain), {metrics['select_accept']:.3f} ({select.spec}), "
                       "accuracy per step " + " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.setup.eval_steps)))
        if metrics["select_accept"] > self.state.best_score:
            self.state.best_score, self.state.best_by = metrics["select_accept"], select.spec
            self.state.best_step = self.state.step
            self.save(best_only=True)


def train(recipe: Any, target_model: Any = None, stop_at_step: int | None = None) -> dict:
    """Train a draft head for `recipe`; returns step, outcome, checkpoint paths and the last eval.

    `target_model`: an already loaded target (the online source and tests reuse it).
    `stop_at_step`: behave as if preempted once this step is done (checkpoint, return).
    """
    started = time.perf_counter()
    trainer = Trainer(recipe, target_model)
    try:
        result = trainer.run(stop_at_step)
    finally:  # a failure before run's own close (a refused resume) still stops what the source started
        trainer.setup.source.close()
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    def body(recipe: Recipe, args: Any) -> int:
        ran, result = stages.run("train", recipe, lambda: train(recipe), force=args.force,
                                 files=lambda r: [r["checkpoint"]], finished=lambda r: r["outcome"] == "done")
        if ran and int(os.environ.get("RANK", "0")) == 0:
            best = f"{result['best_score']:.3f}" if result["best_score"] >= 0 else "n/a"
            print(f"eyas train: {result['outcome']} at step {result['step']} in {result['seconds']:.0f} s; "
                  f"newest checkpoint {result['checkpoint']}, best {result['best']} (simulated acceptance "
                  f"{best} of {result['best_by'] or 'n/a'})")
        return 0

    return stage_main("train", argv, body)


if __name__ == "__main__":
    sys.exit(main())
