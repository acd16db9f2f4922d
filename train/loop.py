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
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


# ----------------------------------------------------------------------------- setup


def resolve_mixed_precision(setting: str) -> str:
    """The accelerate mixed_precision value: auto = bf16 on a GPU that has it, else none."""
    if setting in ("no", "fp32"):
        return "no"
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def make_accelerator(recipe: Any, find_unused: bool) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration

    from eyas.train.metrics import tracker_settings

    log_with, project_dir = tracker_settings(recipe)
    # accelerate drops DeepSpeed when cpu=True; on a machine without a GPU DeepSpeed runs on its
    # own CPU accelerator, and the process group has to be gloo (accelerate only knows GPU backends there).
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=find_unused)]
    if deepspeed and not torch.cuda.is_available():
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    _forget_previous_run_settings()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available() and not deepspeed,
        mixed_precision=resolve_mixed_precision(recipe.train.mixed_precision),
        gradient_accumulation_steps=recipe.train.grad_accum,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=str(project_dir), logging_dir=str(project_dir)),
        kwargs_handlers=handlers,
    )
    if accelerator.device.type == "cpu":  # ranks sharing a CPU split its cores instead of oversubscribing
        local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return accelerator


def _forget_previous_run_settings() -> None:
    """Let a second training run in one process choose its own mixed precision.

    accelerate keeps its settings in a process-wide singleton and refuses a new Accelerator
    whose mixed precision differs from the first one's (the quickstart's bf16 run followed by
    an fp32 one in the same Python process, as the tests do). The per-run part is dropped; the
    distributed setup (PartialState: process group, ranks) is kept.
    """
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


def configure_deepspeed(accelerator: Any, train_cfg: Any) -> None:
    """Fill the DeepSpeed values eyas owns (a token-budget loader has no batch size of its own)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    # One "sample" per micro-batch for DeepSpeed's bookkeeping; eyas sizes batches in tokens.
    config["train_micro_batch_size_per_gpu"] = 1
    config["gradient_accumulation_steps"] = int(train_cfg.grad_accum)
    config["train_batch_size"] = int(train_cfg.grad_accum) * accelerator.num_processes
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = float(train_cfg.max_grad_norm)


def lr_lambda(total_steps: int, warmup: int, min_ratio: float):
    """Linear warmup to the peak over `warmup` steps, then cosine decay to `min_ratio` of it."""

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclass
class Source:
    """Where batches come from: loaders for both splits and, online, the target that makes features."""

    train_reader: Any
    heldout_reader: Any  # None: evaluate on a deterministic slice of the train data
    aux_layers: list[int]
    d2t: torch.Tensor | None
    features: Any = None  # OnlineFeatures when train.source is online
    description: str = ""


def open_source(recipe: Any, target_config: Any, identity: str, device: Any, target_model: Any = None) -> Source:
    from eyas.config import default_layers
    from eyas.data.vocab import load_vocab
    from eyas.train.heads import uses_draft_vocab

    kind, run_dir = recipe.draft.kind, recipe.run_dir
    want_vocab = uses_draft_vocab(recipe.draft)
    if recipe.train.source == "shards":
        from eyas.train.data import open_shards

        shards = open_shards(run_dir, kind, int(target_config.hidden_size), recipe.dump.layers, identity)
        d2t = load_vocab(shards["root"])[0] if want_vocab else None
        reader = shards["train"]
        desc = (f"shards {shards['root']} ({len(reader)} samples, {reader.manifest.get('num_tokens')} tokens, "
                f"{reader.manifest.get('encoding')})")
        return Source(reader, shards["heldout"], shards["layers"], d2t, None, desc)
    from eyas.data.prepare import load_prepared
    from eyas.train.online import OnlineFeatures, PreparedReader

    if target_model is None:
        from eyas.targets import load_target

        target_model, _ = load_target(recipe.target, device)
    layers = (list(recipe.dump.layers) or default_layers(int(target_config.num_hidden_layers))) if kind == "eagle3" else []
    train_reader = PreparedReader(load_prepared(run_dir, "train"))
    heldout = load_prepared(run_dir, "heldout")
    d2t = _online_vocab(recipe, train_reader, int(target_config.vocab_size)) if want_vocab else None
    return Source(train_reader, PreparedReader(heldout) if len(heldout) else None, layers, d2t,
                  OnlineFeatures(target_model, layers),
                  f"online: target in the loop over {run_dir / 'prepared'} ({len(train_reader)} samples)")


def _online_vocab(recipe: Any, reader: Any, vocab_size: int) -> torch.Tensor:
    """The dump's vocabulary when one exists, else the same one built from the prepared data."""
    from eyas.data.vocab import VOCAB_FILE, build_vocab, count_tokens, load_vocab

    shards = recipe.run_dir / "shards"
    if (shards / VOCAB_FILE).is_file():
        return load_vocab(shards)[0]
    return build_vocab(count_tokens(reader.dataset, vocab_size), recipe.dump.draft_vocab_size)[0]


# ----------------------------------------------------------------------------- state


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    best_sim_accept: float = -1.0
    best_step: int = -1
    last_eval: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "best_sim_accept": self.best_sim_accept,
                "best_step": self.best_step, "last_eval": self.last_eval}


class StopSignals:
    """Records SIGTERM/SIGUSR1 instead of dying; the loop checkpoints and exits at a step boundary."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        import threading

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


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """Holds everything one run needs; `run()` trains to the end, a signal, or `stop_at_step`."""

    def __init__(self, recipe: Any, target_model: Any = None) -> None:
        from accelerate.utils import set_seed

        from eyas.config import check_against_target, parse_loss_mix
        from eyas.targets import load_target_config, load_tokenizer, target_identity
        from eyas.train.heads import build_head
        from eyas.train.losses import Teacher
        from eyas.train.ttt import default_token_feed

        self.recipe, self.cfg = recipe, recipe.train
        self.kind = recipe.draft.kind
        self.run_dir = recipe.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        target_config = target_model.config if target_model is not None else load_target_config(recipe.target.path)
        check_against_target(recipe, target_config)
        self.identity = target_identity(target_config, load_tokenizer(recipe.target))
        self.train_steps = 1 if self.kind == "eagle" else self.cfg.ttt_steps  # EAGLE-1 trains one step + features
        self.eval_steps = self.cfg.ttt_steps
        unused = self.kind == "mtp" and self.train_steps < recipe.draft.num_steps
        self.accelerator = make_accelerator(recipe, find_unused=unused)
        acc = self.accelerator
        self.device = acc.device
        self.source = open_source(recipe, target_config, self.identity, self.device, target_model)
        set_seed(recipe.run.seed)
        head = build_head(recipe.draft, target_config, self.source.aux_layers, self.source.d2t, self.identity)
        embed, lm_head, norm = self._target_weights(target_model)
        head.init_from_target_weights(embed, lm_head, norm)
        self.head_config = dict(head.config)
        teacher_dtype = torch.bfloat16 if acc.mixed_precision == "bf16" and self.device.type == "cuda" else torch.float32
        self.teacher = Teacher(lm_head, self.source.d2t if head.d2t is not None else None, self.cfg.teacher_chunk,
                               teacher_dtype, self.device)
        self.mix = parse_loss_mix(self.cfg.loss)
        self.token_feed = default_token_feed(self.kind) if self.cfg.ttt_token_feed == "auto" else self.cfg.ttt_token_feed
        self.weights = [self.cfg.ttt_decay ** k for k in range(self.train_steps)]
        self.loader = self.make_loader(self.source.train_reader, shuffle=True)
        batches = len(self.loader)
        if batches == 0:
            raise EyasError(f"the training data gives no batch to each of {acc.num_processes} process(es); "
                            "use more data or a smaller train.token_budget")
        self.batches_per_epoch = batches
        self.total_steps = self.cfg.max_steps or max(1, math.ceil(self.cfg.epochs * batches / self.cfg.grad_accum))
        optimizer = torch.optim.AdamW(head.trainable_parameters(), lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                      weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.total_steps, self.cfg.warmup_steps, self.cfg.min_lr_ratio))
        from eyas.train.heads import count_parameters

        self.param_counts = count_parameters(head)  # before ZeRO-3 partitions the weights
        configure_deepspeed(acc, self.cfg)
        head.to(self.device)
        self.model, self.optimizer = acc.prepare(head, optimizer)
        self.state = TrainState()
        self.resumed_from: Path | None = None

    # -- pieces

    def _target_weights(self, target_model: Any):
        if target_model is not None:
            base = getattr(target_model, "model", target_model)
            norm = base.norm.weight.detach().float() if hasattr(base, "norm") else None
            return (target_model.get_input_embeddings().weight.detach().float(),
                    target_model.get_output_embeddings().weight.detach().float(), norm)
        if self.source.features is not None:
            return self._target_weights(self.source.features.model)
        from eyas.train.data import read_target_weights

        return read_target_weights(self.recipe.target.path)

    def make_loader(self, reader: Any, shuffle: bool) -> Any:
        from eyas.data.shards import TokenBudgetLoader

        acc = self.accelerator
        return TokenBudgetLoader(reader, self.cfg.token_budget, seed=self.recipe.run.seed,
                                 rank=acc.process_index, world_size=acc.num_processes, shuffle=shuffle)

    @property
    def head(self) -> Any:
        return self.accelerator.unwrap_model(self.model)

    def _prepare_batch(self, batch: dict) -> dict:
        from eyas.train.data import to_device

        batch = to_device(batch, self.device)
        if self.source.features is not None:
            batch = self.source.features(batch)
        return batch

    # -- one optimizer step

    def train_step(self, micro: list[tuple[dict, dict]]) -> dict:
        from eyas.train.ttt import step_counts

        acc, steps = self.accelerator, self.train_steps
        local = torch.zeros(steps, device=self.device)
        for batch, _ in micro:
            mask = batch["loss_mask"].float() * batch["attention_mask"].float()
            local += torch.stack(step_counts(mask, steps)).to(self.device)
        counts = acc.reduce(local, reduction="sum").clamp(min=1.0)
        scale = acc.num_processes * self.cfg.grad_accum  # undo DDP's mean over ranks and accelerate's / grad_accum
        sums = torch.zeros(2 * steps + 2, device=self.device)  # loss_k, correct_k, feature loss, tokens
        for index, (batch, position) in enumerate(micro):
            batch = self._prepare_batch(batch)
            with acc.accumulate(self.model):
                out = self.model(batch, self.teacher, steps, self.mix, token_feed=self.token_feed,
                                 feature_loss=self.kind == "eagle")
                loss = sum(w * s / c for w, s, c in zip(self.weights, out["loss_sums"], counts)) * scale
                if out["feature_loss_sum"] is not None:
                    loss = loss + self.cfg.feature_loss_weight * out["feature_loss_sum"] / counts[0] * scale
                self._check_finite(loss, index, position)
                acc.backward(loss)
            sums[:steps] += torch.stack([s.detach().float() for s in out["loss_sums"]])
            sums[steps:2 * steps] += torch.stack([c.float() for c in out["correct"]])
            if out["feature_loss_sum"] is not None:
                sums[2 * steps] += out["feature_loss_sum"].detach().float()
            sums[2 * steps + 1] += batch["attention_mask"].sum()
        grad_norm = None
        if self.cfg.max_grad_norm > 0:
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._step_metrics(sums, counts, grad_norm, lr)

    def _check_finite(self, loss: torch.Tensor, index: int, position: dict) -> None:
        bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], device=self.device)
        if float(self.accelerator.reduce(bad, reduction="sum")) == 0:
            return
        from eyas.train.checkpoint import latest_checkpoint

        last = latest_checkpoint(self.ckpt_root)
        value = float(loss.detach()) if torch.isfinite(loss.detach()).all() else loss.detach().item()
        raise EyasError(
            f"non-finite loss at step {self.state.step + 1} (rank {self.accelerator.process_index}: loss {value}, "
            f"micro-batch {index + 1}/{self.cfg.grad_accum}, data epoch {position['epoch']} batch {position['position']}); "
            f"stopped before the optimizer step. Last good checkpoint: {last or 'none yet'}. "
            "Lower train.lr or check the shards (eyas.data.shards.verify), then resume from it"
        )

    def _step_metrics(self, sums: torch.Tensor, counts: torch.Tensor, grad_norm: Any, lr: float) -> dict:
        steps = self.train_steps
        sums = self.accelerator.reduce(sums, reduction="sum").cpu()
        counts = counts.cpu()
        metrics: dict = {"lr": lr}
        total = 0.0
        for k in range(steps):
            loss_k = float(sums[k] / counts[k])
            metrics[f"loss_{k}"] = loss_k
            metrics[f"acc_{k}"] = float(sums[steps + k] / counts[k])
            total += self.weights[k] * loss_k
        if self.kind == "eagle":
            metrics["feature_loss"] = float(sums[2 * steps] / counts[0])
            total += self.cfg.feature_loss_weight * metrics["feature_loss"]
        metrics["loss"] = total
        metrics["tokens"] = int(sums[2 * steps + 1])
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    # -- held-out evaluation

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-step loss and accuracy (against the target's full-vocab argmax) and simulated acceptance."""
        from eyas.data.shards import pad_batch
        from eyas.train.ttt import simulated_acceptance_length

        acc, steps = self.accelerator, self.eval_steps
        reader = self.source.heldout_reader or self.source.train_reader
        mine, rounds, spare = self._eval_batches(reader)
        sums = torch.zeros(3 * steps, device=self.device)
        self.model.eval()
        for index in range(rounds):
            # Every rank runs the same number of forwards (FSDP/ZeRO-3 gather weights collectively);
            # a rank short of batches repeats one and discards the result.
            real = index < len(mine)
            batch = self._prepare_batch(pad_batch([reader.sample(int(i)) for i in (mine[index] if real else spare)]))
            out = self.model(batch, self.teacher, steps, self.mix, token_feed=self.token_feed,
                             teacher_top=self._reference_argmax(batch))
            if real:
                sums[:steps] += torch.stack([s.float() for s in out["loss_sums"]])
                sums[steps:2 * steps] += torch.stack([c.float() for c in out["correct"]])
                sums[2 * steps:] += torch.stack([c.float() for c in out["counts"]])
        self.model.train()
        sums = acc.reduce(sums, reduction="sum").cpu()
        counts = sums[2 * steps:].clamp(min=1.0)
        accuracy = [float(sums[steps + k] / counts[k]) for k in range(steps)]
        metrics = {f"acc_{k}": a for k, a in enumerate(accuracy)}
        metrics.update({f"loss_{k}": float(sums[k] / counts[k]) for k in range(steps)})
        metrics["sim_accept"] = simulated_acceptance_length(accuracy)
        metrics["positions"] = int(sums[2 * steps])
        metrics["split"] = "heldout" if self.source.heldout_reader is not None else "train-slice"
        return metrics

    def _eval_batches(self, reader: Any) -> tuple[list, int, Any]:
        """This rank's share of the first `train.eval_batches` batches (longest first, unshuffled).

        The same global batches whatever the number of processes, so held-out figures of a
        1-process and an N-process run agree; returns (this rank's index arrays, rounds, a spare
        batch for ranks with fewer).
        """
        import numpy as np

        from eyas.data.shards import budget_batches

        lengths = reader.lengths
        order = np.argsort(-lengths, kind="stable")
        batches = budget_batches(order, lengths, self.cfg.token_budget)[: self.cfg.eval_batches]
        if not batches:
            raise EyasError("the held-out data is empty; dump a held-out split (data.heldout_fraction > 0)")
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        return batches[rank::world], math.ceil(len(batches) / world), batches[0]

    def _reference_argmax(self, batch: dict) -> torch.Tensor:
        """What greedy verification accepts: the target's argmax over its full vocabulary, as draft ids."""
        if "last_hidden" in batch:
            return self.teacher.full_argmax_in_draft(batch["last_hidden"])
        return self.teacher.to_draft_ids(batch["topk_ids"][..., 0].long())

    # -- checkpoints

    def save(self, best_only: bool = False) -> Path:
        """Save a step checkpoint (every rank takes part), or only the draft into `best/`."""
        from eyas.train import checkpoint as ckpt

        acc = self.accelerator
        name = "best" if best_only else ckpt.step_dir(self.ckpt_root, self.state.step).name
        final = self.ckpt_root / name
        partial = self.ckpt_root / f"{name}.partial"
        if acc.is_main_process:
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        acc.wait_for_everyone()
        state_dict = acc.get_state_dict(self.model)
        meta = {"step": self.state.step, "eval": self.state.last_eval, "run": self.recipe.run.name,
                "tokens": self.state.tokens, "train_steps": self.train_steps, "ttt_steps": self.cfg.ttt_steps}
        if not best_only:
            acc.save_state(str(partial / "state"))
            ckpt.write_json(partial / f"loader_rank{acc.process_index}.json", self.position)
        if acc.is_main_process:
            ckpt.save_draft(partial, self.head, meta, state_dict)
            if not best_only:
                ckpt.write_json(partial / ckpt.TRAINER_FILE, {
                    **self.state.to_dict(), "scheduler": self.scheduler.state_dict(),
                    "world_size": acc.num_processes, "head_config": self.head_config,
                    "total_steps": self.total_steps})
        acc.wait_for_everyone()
        if acc.is_main_process:
            ckpt.publish(partial, final)
            if not best_only:
                ckpt.prune_checkpoints(self.ckpt_root, self.cfg.keep_last)
        acc.wait_for_everyone()
        return final

    def resume(self) -> None:
        """Restore everything from the newest complete checkpoint, if resuming is on and there is one."""
        from eyas.train import checkpoint as ckpt

        latest = ckpt.latest_checkpoint(self.ckpt_root) if self.cfg.resume else None
        if latest is None:
            return
        saved = ckpt.read_trainer_state(latest)
        diffs = ckpt.compatibility_errors(saved["head_config"], self.head_config)
        if diffs:
            raise EyasError(f"cannot resume from '{latest}': the checkpoint's draft differs from this run's ("
                            + "; ".join(diffs) + "); set train.resume=false or use another run.name")
        if saved["world_size"] != self.accelerator.num_processes:
            raise EyasError(f"cannot resume from '{latest}': it was written by {saved['world_size']} process(es), this "
                            f"run has {self.accelerator.num_processes}; the data position is per process, so resume "
                            "with the same number, or set train.resume=false")
        position_file = latest / f"loader_rank{self.accelerator.process_index}.json"
        if not (latest / "state").is_dir() or not position_file.is_file():
            raise EyasError(f"'{latest}' lacks its training state (state/ or {position_file.name}); "
                            "delete it to resume from the one before")
        self.accelerator.load_state(str(latest / "state"))
        self.scheduler.load_state_dict(saved["scheduler"])
        import json

        self.loader.load_state_dict(json.loads(position_file.read_text()))
        self.position = self.loader.state_dict()
        self.state = TrainState(step=saved["step"], tokens=saved["tokens"], best_sim_accept=saved["best_sim_accept"],
                                best_step=saved["best_step"], last_eval=saved.get("last_eval", {}))
        self.resumed_from = latest

    # -- the loop

    def run(self, stop_at_step: int | None = None) -> dict:
        from eyas.config import save_resolved
        from eyas.train.data import BatchStream
        from eyas.train.metrics import MetricsLogger

        acc, cfg = self.accelerator, self.cfg
        self.position = self.loader.state_dict()
        self.resume()
        if acc.is_main_process:
            save_resolved(self.recipe, self.ckpt_root)
        logger = MetricsLogger(acc, self.recipe, self.total_steps, self.state.step)
        trainable, total = self.param_counts
        logger.message(
            f"eyas train: {self.kind} head ({trainable:,} trainable of {total:,} parameters), "
            f"{self.total_steps} steps of {acc.num_processes} x {cfg.grad_accum} x {cfg.token_budget} tokens, "
            f"TTT {self.train_steps} step(s); {self.source.description}; device {self.device}, "
            f"mixed precision {acc.mixed_precision}"
            + (f"; resumed from {self.resumed_from} (step {self.state.step})" if self.resumed_from else ""))
        signals = StopSignals().install()
        stream = BatchStream(self.loader, cfg.prefetch)
        outcome = "done"
        try:
            while self.state.step < self.total_steps:
                micro = [next(stream) for _ in range(cfg.grad_accum)]
                metrics = self.train_step(micro)
                self.position = micro[-1][1]
                self.state.step += 1
                self.state.tokens += metrics["tokens"]
                logger.advance(1, metrics["tokens"])
                step = self.state.step
                if step % cfg.log_every == 0 or step == self.total_steps:
                    logger.log(step, {**metrics, **logger.rates()})
                last = step == self.total_steps
                if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                    self._evaluate_and_keep_best(logger)
                stop = self._stop_requested(signals, stop_at_step)
                if (cfg.save_every and step % cfg.save_every == 0) or last or stop:
                    path = self.save()
                    if stop:
                        outcome = signals.received or "stop_at_step"
                        logger.message(f"eyas train: {outcome} at step {step}: saved {path}; exiting "
                                       "(run the same command again to resume)")
                        break
        finally:
            stream.close()
            signals.restore()
            logger.close()
            if self.source.features is not None:
                self.source.features.close()
        from eyas.train.checkpoint import best_checkpoint, latest_checkpoint

        return {"step": self.state.step, "outcome": outcome, "checkpoint": latest_checkpoint(self.ckpt_root),
                "best": best_checkpoint(self.run_dir), "best_sim_accept": self.state.best_sim_accept,
                "last_eval": self.state.last_eval}

    def _stop_requested(self, signals: StopSignals, stop_at_step: int | None) -> bool:
        """Every rank agrees: a signal on any rank (or the requested step) stops all of them."""
        local = 1.0 if signals.received or (stop_at_step is not None and self.state.step >= stop_at_step) else 0.0
        flag = self.accelerator.reduce(torch.tensor([local], device=self.device), reduction="sum")
        if float(flag) > 0 and signals.received is None and stop_at_step is None:
            signals.received = "signal on another rank"
        return float(flag) > 0

    def _evaluate_and_keep_best(self, logger: Any) -> None:
        metrics = self.evaluate()
        self.state.last_eval = {**metrics, "step": self.state.step}
        logger.log(self.state.step, metrics, kind="eval")
        logger.message(f"eyas train: step {self.state.step} held-out ({metrics['split']}): simulated acceptance "
                       f"{metrics['sim_accept']:.3f}, accuracy per step "
                       + " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.eval_steps)))
        if metrics["sim_accept"] > self.state.best_sim_accept:
            self.state.best_sim_accept = metrics["sim_accept"]
            self.state.best_step = self.state.step
            self.save(best_only=True)


def train(recipe: Any, target_model: Any = None, stop_at_step: int | None = None) -> dict:
    """Train a draft head for `recipe`; returns step, outcome, checkpoint paths and the last eval.

    `target_model`: an already loaded target (the online source and tests reuse it).
    `stop_at_step`: behave as if preempted once this step is done (checkpoint, return).
    """
    started = time.perf_counter()
    trainer = Trainer(recipe, target_model)
    result = trainer.run(stop_at_step)
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    from eyas.cli import guarded, stage_parser
    from eyas.config import load_recipe

    args = stage_parser("eyas train", "train a draft head (eagle, eagle3, mtp) from shards or online").parse_args(argv)

    def body() -> int:
        result = train(load_recipe(args.recipe, args.overrides))
        if int(os.environ.get("RANK", "0")) == 0:
            best = f"{result['best_sim_accept']:.3f}" if result["best_sim_accept"] >= 0 else "n/a"
            print(f"eyas train: {result['outcome']} at step {result['step']} in {result['seconds']:.0f} s; "
                  f"newest checkpoint {result['checkpoint']}, best {result['best']} (simulated acceptance {best})")
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
