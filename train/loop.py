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

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration, set_seed
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from eyas import stages
from eyas.config import (
    Recipe,
    check_against_target,
    parse_loss_mix,
    reads_drafted_tokens,
    save_resolved,
    selected_shape,
    token_feed,
    tree_width,
)
from eyas.cpus import threads_per_process
from eyas.data.batches import budget_batches
from eyas.data.prepare import load_prepared
from eyas.data.vocab import VOCAB_FILE, build_vocab, count_tokens, load_vocab
from eyas.draft.checkpoint import save_draft
from eyas.draft.config import target_shapes
from eyas.draft.head import DraftHead, count_parameters, init_layers_from_target
from eyas.draft.registry import build_head, head_class, uses_draft_vocab
from eyas.draft.ttt_attention import dense_fallback_reason
from eyas.errors import EyasError
from eyas.io import fresh_partial, publish_dir, sha256_file
from eyas.precision import mixed_precision_for
from eyas.shapes import ranks_needed, simulated_acceptance, simulated_acceptance_length
from eyas.stage_cli import stage_main
from eyas.targets import load_target, load_target_config, load_tokenizer, target_identity
from eyas.train import checkpoint as ckpt
from eyas.train import trust
from eyas.train.data import open_shards, read_target_layer, read_target_weights
from eyas.train.loader import BatchStream, TokenBudgetLoader, read_batch, to_device
from eyas.train.losses import Teacher
from eyas.train.memory import refuse_if_too_big, sharding_of
from eyas.train.metrics import MetricsLogger, tracker_settings
from eyas.train.online import OnlineFeatures, PreparedReader
from eyas.train.rank_zero import RankZeroWork
from eyas.train.ttt import TrainingUnroll, TreeLevers, head_state, step_counts

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


# ----------------------------------------------------------------------------- setup


def make_accelerator(recipe: Recipe, find_unused: bool) -> Accelerator:
    log_with, project_dir = tracker_settings(recipe)
    # accelerate drops DeepSpeed when cpu=True; on a machine without a GPU DeepSpeed runs on its
    # own CPU accelerator, and the process group has to be gloo (accelerate only knows GPU backends there).
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    # backend None: accelerate's own choice (NCCL on GPUs, gloo on CPUs); accelerate leaves out a timeout equal to
    # its default (600 s), which is torch's NCCL default too
    backend = "gloo" if deepspeed and not torch.cuda.is_available() else None
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=find_unused),
                InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=recipe.train.dist_timeout_s))]
    _forget_previous_run_settings()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available() and not deepspeed,
        mixed_precision=mixed_precision_for(recipe.train.mixed_precision),
        gradient_accumulation_steps=recipe.train.grad_accum,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=str(project_dir), logging_dir=str(project_dir)),
        kwargs_handlers=handlers,
    )
    if accelerator.device.type == "cpu":  # ranks sharing a CPU split its cores instead of oversubscribing
        torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))))
    return accelerator


def _forget_previous_run_settings() -> None:
    """Let a second training run in one process choose its own mixed precision.

    accelerate keeps its settings in a process-wide singleton and refuses a new Accelerator
    whose mixed precision differs from the first one's (the quickstart's bf16 run followed by
    an fp32 one in the same Python process, as the tests do). The per-run part is dropped; the
    distributed setup (PartialState: process group, ranks) is kept.
    """
    AcceleratorState._reset_state(reset_partial_state=False)


def configure_deepspeed(accelerator: Any, train_cfg: Any, load_universal: bool = False) -> None:
    """Fill the DeepSpeed values eyas owns (a token-budget loader has no batch size of its own).

    `load_universal`: the resume reads a universal checkpoint (another number of processes wrote it)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    if load_universal:
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    # One "sample" per micro-batch for DeepSpeed's bookkeeping; eyas sizes batches in tokens.
    config["train_micro_batch_size_per_gpu"] = 1
    config["gradient_accumulation_steps"] = int(train_cfg.grad_accum)
    config["train_batch_size"] = int(train_cfg.grad_accum) * accelerator.num_processes
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = float(train_cfg.max_grad_norm)


def module_cast(accelerator: Any) -> bool:
    """Whether the trained module itself is cast to a low precision: DeepSpeed's bf16/fp16 cast every parameter
    and buffer and keep fp32 master weights in the optimizer; accelerate's autocast (DDP, FSDP) keeps the
    module in fp32 and casts per op."""
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None and accelerator.mixed_precision in ("bf16", "fp16")


def frozen_originals(accelerator: Any, head: DraftHead) -> dict[str, torch.Tensor]:
    """The frozen tensors (the target's embedding, lm_head, norm copies) as fp32 CPU copies, kept by the main
    process where the module is about to be cast (`module_cast`): no optimizer keeps an fp32 copy of them, and
    the draft is saved with the target's exact weights. Empty elsewhere (the module keeps them as they are)."""
    if not (module_cast(accelerator) and accelerator.is_main_process):
        return {}
    return {f"head.{name}": p.detach().to("cpu", copy=True) for name, p in head.named_parameters() if not p.requires_grad}


def saved_weights(accelerator: Any, model: Any, frozen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The trained module's weights as a checkpoint saves them: accelerate's state dict (gathered under ZeRO-3;
    None on the other ranks there), and under `module_cast` the optimizer's fp32 master weights in place of the
    module's rounded copies, the frozen ones from `frozen`, so the saved draft (and its export) is fp32 as
    with DDP. Every rank calls it: gathering a master weight is a collective."""
    state = accelerator.get_state_dict(model)
    if not module_cast(accelerator):
        return state
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in accelerator.unwrap_model(model).named_parameters():  # the same order on every rank
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        if master is not None:
            masters[name] = master.to("cpu")
    if state is None:
        return None
    return {name: _fp32_copy(name, tensor, masters, frozen) for name, tensor in state.items()}


def _fp32_copy(name: str, tensor: torch.Tensor, masters: dict, frozen: dict) -> torch.Tensor:
    """One saved tensor under `module_cast`: its master weight, else its kept original, else the module's cast
    back (the fallbacks are only computed where needed: a frozen 8B embedding is 2 GiB in fp32)."""
    if name in masters:
        return masters[name]
    if name in frozen:
        return frozen[name]
    return tensor.float() if tensor.is_floating_point() else tensor


def no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Norm weights and biases (1-D parameters) take no weight decay, as in every LM trainer."""
    return param.ndim < 2 or name.endswith(".bias")


def make_optimizer(head: DraftHead, cfg: Any) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; weight decay on matrices only (groups tagged `decay`)."""
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not no_decay(n, p)], "decay": True},
              {"params": [p for n, p in named if no_decay(n, p)], "decay": False}]
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    set_optimizer_settings(optimizer, cfg)
    return optimizer


def set_optimizer_settings(optimizer: torch.optim.Optimizer, cfg: Any) -> None:
    """The recipe's betas and weight decay on every group (also after a resume restored the saved ones)."""
    for group in optimizer.param_groups:
        group["betas"] = tuple(cfg.betas)
        group["weight_decay"] = cfg.weight_decay if group.get("decay", True) else 0.0


# Settings a resume cannot change: they fix the data order, the batch shapes or the numerics of
# the saved optimizer and data state. Every other train.* setting is applied from the recipe.
# draft_init: the resumed weights are the trained ones, so a changed init could not be applied
FIXED_ON_RESUME = ("source", "token_budget", "ttt_steps", "ttt_token_feed", "mixed_precision", "draft_init")
# Settings that do not change a step's numerics and need no word when they differ.
QUIET_ON_RESUME = ("resume", "trust_checkpoint", "log_every", "logger", "wandb_project", "prefetch", "loader_workers")


def changed_settings(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """train.* settings that differ between a checkpoint's run and this one: {key: (saved, now)}."""
    return {k: (saved[k], v) for k, v in current.items()
            if k in saved and k not in QUIET_ON_RESUME and _as_list(saved[k]) != _as_list(v)}


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass
class Source:
    """Where batches come from: loaders for both splits and, online, the target that makes features."""

    train_reader: Any
    heldout_reader: Any  # None: evaluate on a deterministic slice of the train data
    aux_layers: list[int]
    d2t: torch.Tensor | None
    features: Any = None  # OnlineFeatures when train.source is online
    description: str = ""


def open_source(recipe: Recipe, target_config: Any, identity: str, device: Any, target_model: Any = None) -> Source:
    kind, run_dir = recipe.draft.kind, recipe.run_dir
    want_vocab = uses_draft_vocab(recipe.draft)
    if recipe.train.source == "shards":
        shards = open_shards(run_dir, kind, int(target_config.hidden_size), recipe.dump.layers, identity)
        d2t = load_vocab(shards["root"])[0] if want_vocab else None
        reader = shards["train"]
        desc = (f"shards {shards['root']} ({len(reader)} samples, {reader.manifest.get('num_tokens')} tokens, "
                f"{reader.manifest.get('encoding')})")
        return Source(reader, shards["heldout"], shards["layers"], d2t, None, desc)
    if target_model is None:
        target_model, _ = load_target(recipe.target, device)
    layers = head_class(kind).feature_spec.target_layers(recipe.dump.layers, int(target_config.num_hidden_layers))
    train_reader = PreparedReader(load_prepared(run_dir, "train"))
    heldout = load_prepared(run_dir, "heldout")
    d2t = _online_vocab(recipe, train_reader, int(target_config.vocab_size)) if want_vocab else None
    return Source(train_reader, PreparedReader(heldout) if len(heldout) else None, layers, d2t,
                  OnlineFeatures(target_model, layers),
                  f"online: target in the loop over {run_dir / 'prepared'} ({len(train_reader)} samples)")


def _online_vocab(recipe: Recipe, reader: Any, vocab_size: int) -> torch.Tensor:
    """The dump's vocabulary when one exists, else the same one built from the prepared data."""
    shards = recipe.run_dir / "shards"
    if (shards / VOCAB_FILE).is_file():
        return load_vocab(shards)[0]
    return build_vocab(count_tokens(reader.dataset, vocab_size), recipe.dump.draft_vocab_size)[0]


# ----------------------------------------------------------------------------- state


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    best_score: float = -1.0  # the held-out figure `best/` was chosen by (`best_by`'s simulated acceptance)
    best_by: str = ""         # the shape whose simulated acceptance chose `best/` (train.select_shape)
    best_step: int = -1
    last_eval: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "best_score": self.best_score, "best_by": self.best_by,
                "best_step": self.best_step, "last_eval": self.last_eval}


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
    """One optimizer step's sums, left on the device: `Trainer.step_metrics` reads them, at log steps only (a read
    is a host sync on a GPU, and a step that is not logged needs none but the finite check and the stop vote)."""

    totals: Totals              # this process's sums
    counts: torch.Tensor        # [steps] loss-masked positions over every process (the loss's denominators)
    grad_norm: Any              # the clipped gradient's norm (a tensor), or None without clipping
    lr: float
    steps: int                  # unroll depth of this step


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


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """Holds everything one run needs; `run()` trains to the end, a signal, or `stop_at_step`.

    Built in named steps: the target's identity, the accelerator, the data source, the head,
    the teacher, the loader and optimizer, accelerate's wrapping of the training unroll, then the schedule.
    """

    def __init__(self, recipe: Recipe, target_model: Any = None) -> None:
        self.recipe, self.cfg = recipe, recipe.train
        self.kind = recipe.draft.kind
        self.run_dir = recipe.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.kind_class = head_class(self.kind)
        target_config = self._check_target(target_model)
        # EAGLE-1 trains one step (plus its feature regression); the held-out eval unrolls the full depth
        self.train_steps = self.kind_class.unroll_steps(self.cfg.ttt_steps)
        self.eval_steps = self.cfg.ttt_steps
        # `best/` is the checkpoint whose held-out simulated acceptance of this shape is highest
        self.select = selected_shape(recipe)
        # per-step layers past the unroll depth get no gradient while the depth ramps up (an unroll
        # shorter than an mtp draft's layers is refused by check_against_target)
        unused = self.kind_class.layout.weights_per_step and self.cfg.ttt_ramp_steps > 0
        self.accelerator = make_accelerator(recipe, find_unused=unused)
        self.device = self.accelerator.device
        self.rank_zero = RankZeroWork(self.accelerator, self.cfg.dist_timeout_s)
        self.resume_from = ckpt.latest_checkpoint(self.ckpt_root) if self.cfg.resume else None
        self.resize = ckpt.plan_resize(self.resume_from, self.accelerator.num_processes, self.cfg.grad_accum)
        if self.resize:  # before anything sizes itself by grad_accum: the loader, the schedule, DeepSpeed
            self.cfg = dataclasses.replace(self.cfg, grad_accum=self.resize.accum)
            self.recipe = recipe = dataclasses.replace(recipe, train=self.cfg)
            self.accelerator.gradient_accumulation_steps = self.resize.accum
        self.processes_changed = bool(self.resize and self.resize.processes_changed)
        if self.device.type == "cuda":  # a recipe that cannot fit is refused now, before the target and the data load
            refuse_if_too_big("train", recipe, target_config, torch.cuda.get_device_properties(self.device).total_memory,
                              self.accelerator.num_processes, sharding_of(self.accelerator), self.accelerator.mixed_precision,
                              self._dense_attention_reason(target_config))
        self.source = open_source(recipe, target_config, self.identity, self.device, target_model)
        head, lm_head = self._build_head(target_config, target_model)
        self.head_config = head.config
        self.teacher = self._build_teacher(head, lm_head)
        self.mix = parse_loss_mix(self.cfg.loss)
        self.token_feed = token_feed(recipe)
        self.levers = TreeLevers(tree_width(recipe), follow=self.cfg.sibling_feed, align=self.cfg.align_mask)
        # the held-out eval measures a tree's rates in a second pass beside the chain's: along the branch the tree
        # continues (where the unroll reads its drafted tokens), each depth's over the positions the branch reached
        # (the align mask's reach: a verify stops where the target's token is outside the tree's width)
        self.select_width = ranks_needed(self.select)
        self.eval_tree = TreeLevers(self.select_width, follow=reads_drafted_tokens(recipe), align=True) \
            if self.select_width > 1 else None
        self.weights = [self.cfg.ttt_decay ** k for k in range(self.train_steps)]
        self.loader = self.make_loader(self.source.train_reader, shuffle=True)
        optimizer = self._build_optimizer(head)
        self.param_counts = count_parameters(head)  # before ZeRO-3 partitions the weights
        configure_deepspeed(self.accelerator, self.cfg, load_universal=self.processes_changed)
        self.frozen_fp32 = frozen_originals(self.accelerator, head)  # before DeepSpeed's cast
        self.model, self.optimizer = self.accelerator.prepare(
            TrainingUnroll(head.to(self.device), checkpoint_steps=self.cfg.checkpoint_unroll), optimizer)
        # on the optimizer `prepare` returned: FSDP and ZeRO put their own (sharded) parameters in its groups
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, num_warmup_steps=self.cfg.warmup_steps, num_training_steps=self.total_steps,
            min_lr_rate=self.cfg.min_lr_ratio)
        self.state = TrainState()
        self.unread_tokens = torch.zeros((), dtype=torch.long, device=self.device)  # of the steps since their last read
        self.resumed_from: Path | None = None
        self.resume_changes: dict[str, tuple[Any, Any]] = {}
        self.reselect: tuple[str, str] | None = None  # (the shape that chose best/, this run's) where they differ

    # -- build steps

    def _check_target(self, target_model: Any) -> Any:
        """The target's config, checked against the recipe; sets the target identity."""
        recipe = self.recipe
        if target_model is not None:
            target_config = target_model.config
        else:
            target_config = load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
        check_against_target(recipe, target_config)
        self.identity = target_identity(target_config, load_tokenizer(recipe.target))
        return target_config

    def _dense_attention_reason(self, target_config: Any) -> str:
        """Why the unroll's attention would run densely on this GPU ("" where it runs fused, or has one step)."""
        if self.train_steps < 2:
            return ""
        s = target_shapes(target_config)  # the attention layout alone (shapes_of also counts the target's parameters)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision, torch.float32)
        return dense_fallback_reason(self.device, dtype, s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"])

    def _build_head(self, target_config: Any, target_model: Any) -> tuple[DraftHead, torch.Tensor]:
        """A seeded new head with the target's embedding, lm_head and final norm copied in."""
        set_seed(self.recipe.run.seed)
        head = build_head(self.recipe.draft, target_config, self.source.aux_layers, self.source.d2t, self.identity)
        embed, lm_head, norm = self._target_weights(target_model)
        head.init_from_target_weights(embed, lm_head, norm)
        self.init_note = "random init"
        if self.cfg.draft_init == "target_last_layer":
            model = target_model if target_model is not None else getattr(self.source.features, "model", None)
            index, tensors = read_target_layer(self.recipe.target.path, self.recipe.target.trust_remote_code, model)
            copied, kept = init_layers_from_target(head, tensors)
            if not copied:
                raise EyasError(f"train.draft_init=target_last_layer: no tensor of the target's layer {index} fits the "
                                f"{self.kind} head (kept: {', '.join(kept[:4])}); use train.draft_init=random")
            self.init_note = (f"layer(s) from target layer {index}: {len(copied)} tensors copied, {len(kept)} random"
                              + (f" ({', '.join(kept)})" if kept else ""))
        return head, lm_head

    def _build_teacher(self, head: DraftHead, lm_head: torch.Tensor) -> Teacher:
        bf16_cuda = self.accelerator.mixed_precision == "bf16" and self.device.type == "cuda"
        return Teacher(lm_head, self.source.d2t if head.d2t is not None else None, self.cfg.teacher_chunk,
                       torch.bfloat16 if bf16_cuda else torch.float32, self.device)

    def _build_optimizer(self, head: DraftHead) -> torch.optim.Optimizer:
        """The optimizer, and the run's optimizer steps its warmup + cosine schedule spans (built after `prepare`)."""
        batches = len(self.loader)
        if batches == 0:
            raise EyasError(f"the training data gives no batch to each of {self.accelerator.num_processes} process(es); "
                            "use more data or a smaller train.token_budget")
        self.total_steps = self.cfg.max_steps or max(1, math.ceil(self.cfg.epochs * batches / self.cfg.grad_accum))
        return make_optimizer(head, self.cfg)

    # -- pieces

    def _target_weights(self, target_model: Any):
        if target_model is not None:
            base = getattr(target_model, "model", target_model)
            norm = base.norm.weight.detach().float() if hasattr(base, "norm") else None
            return (target_model.get_input_embeddings().weight.detach().float(),
                    target_model.get_output_embeddings().weight.detach().float(), norm)
        if self.source.features is not None:
            return self._target_weights(self.source.features.model)
        return read_target_weights(self.recipe.target.path, trust_remote_code=self.recipe.target.trust_remote_code)

    def make_loader(self, reader: Any, shuffle: bool) -> TokenBudgetLoader:
        acc = self.accelerator
        return TokenBudgetLoader(reader, self.cfg.token_budget, seed=self.recipe.run.seed, rank=acc.process_index,
                                 world_size=acc.num_processes, shuffle=shuffle, grad_accum=self.cfg.grad_accum)

    @property
    def head(self) -> DraftHead:
        return self.accelerator.unwrap_model(self.model).head

    def _prepare_batch(self, batch: dict) -> dict:
        batch = to_device(batch, self.device)
        if self.source.features is not None:
            batch = self.source.features(batch)
        return batch

    # -- one optimizer step

    def unroll_depth(self, step: int) -> int:
        """Draft steps unrolled at optimizer step `step` (0-based): the full depth, or the ramp's.

        A function of the step alone, so a resumed run unrolls exactly as an uninterrupted one."""
        ramp, full = self.cfg.ttt_ramp_steps, self.train_steps
        if ramp <= 0 or full == 1:
            return full
        return min(full, 1 + step * full // ramp)

    def train_step(self, micro: list[tuple[dict, dict]]) -> StepSums:
        acc, steps = self.accelerator, self.unroll_depth(self.state.step)
        local = torch.zeros(steps, device=self.device)
        for batch, _ in micro:
            mask = batch["loss_mask"].float() * batch["attention_mask"].float()
            local += torch.stack(step_counts(mask, steps)).to(self.device)
        counts = acc.reduce(local, reduction="sum").clamp(min=1.0)
        scale = acc.num_processes * self.cfg.grad_accum  # undo DDP's mean over ranks and accelerate's / grad_accum
        totals = Totals.zeros(steps, self.device)
        losses = []  # each micro-batch's loss, kept on the device: read only if one is not finite
        for index, (batch, _) in enumerate(micro):
            batch = self._prepare_batch(batch)
            with acc.accumulate(self.model):
                out = self.model(batch, self.teacher, steps, self.mix, token_feed=self.token_feed, feature_loss=True,
                                 levers=self.levers)
                loss = sum(w * s / c for w, s, c in zip(self.weights, out["loss_sums"], counts)) * scale
                if out["feature_loss_sum"] is not None:
                    loss = loss + self.cfg.feature_loss_weight * out["feature_loss_sum"] / counts[0] * scale
                losses.append(loss.detach())
                if index == len(micro) - 1:  # before the backward that may step (DeepSpeed steps inside it)
                    self._check_finite(torch.stack(losses), [position for _, position in micro])
                acc.backward(loss)
            totals.add(out, tokens=batch["attention_mask"].sum())
        grad_norm = None
        if self.cfg.max_grad_norm > 0:
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepSums(totals, counts, grad_norm, lr, steps)

    def _check_finite(self, losses: torch.Tensor, positions: list[dict]) -> None:
        """Stop before the optimizer step if any rank's loss of this step is not finite: one all-reduce and one
        read on the host per step, before the last micro-batch's backward (not one per micro-batch)."""
        bad = (~torch.isfinite(losses)).float()
        if float(self.accelerator.reduce(bad.sum()[None], reduction="sum")) == 0:
            return
        last = ckpt.latest_checkpoint(self.ckpt_root)
        index = int(bad.argmax()) if bad.any() else 0  # this rank's first bad micro-batch (another rank's: its first)
        position = positions[index]
        raise EyasError(
            f"non-finite loss at step {self.state.step + 1} (rank {self.accelerator.process_index}: loss "
            f"{float(losses[index])}, micro-batch {index + 1}/{self.cfg.grad_accum}, data epoch {position['epoch']} "
            f"batch {position['position']}); stopped before the optimizer step. Last good checkpoint: {last or 'none yet'}. "
            "Lower train.lr or check the shards (eyas.data.shard_verify.verify), then resume from it"
        )

    def step_metrics(self, sums: StepSums) -> dict:
        """The step's losses, accuracies, tokens and gradient norm over every process, read to the host (a collective)."""
        totals, counts, steps = sums.totals.reduced(self.accelerator), sums.counts.cpu(), sums.steps
        grad_norm = sums.grad_norm
        metrics: dict = {"lr": sums.lr}
        if steps != self.train_steps:
            metrics["ttt_depth"] = steps
        total = 0.0
        for k in range(steps):
            loss_k = float(totals.loss[k] / counts[k])
            metrics[f"loss_{k}"] = loss_k
            metrics[f"acc_{k}"] = float(totals.correct[k] / counts[k])
            total += self.weights[k] * loss_k
        if totals.feature_scored:
            metrics["feature_loss"] = float(totals.feature_loss / counts[0])
            total += self.cfg.feature_loss_weight * metrics["feature_loss"]
        metrics["loss"] = total
        metrics["tokens"] = int(totals.tokens)
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    # -- held-out evaluation

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-step loss and accuracy (against the target's full-vocab argmax) and simulated acceptance."""
        steps = self.eval_steps
        reader = self.source.heldout_reader or self.source.train_reader
        mine, rounds, spare = self._eval_batches(reader)
        totals = Totals.zeros(steps, self.device)
        width = self.select_width
        chain = TreeLevers(self.levers.width)  # the draft's own path (its first choices): the chain's figures, the cover
        by_rank = torch.zeros(steps, width + 1, device=self.device)
        cover = torch.zeros(steps, device=self.device)
        self.model.eval()
        for index in range(rounds):
            # Every rank runs the same number of forwards (FSDP/ZeRO-3 gather weights collectively);
            # a rank short of batches repeats one and discards the result.
            real = index < len(mine)
            batch = self._prepare_batch(read_batch(reader, mine[index] if real else spare))
            reference = self._reference_argmax(batch)
            out = self.model(batch, self.teacher, steps, self.mix, token_feed=self.token_feed,
                             teacher_top=reference, ranks=width, levers=chain)
            ranked = out if self.eval_tree is None else self.model(
                batch, self.teacher, steps, self.mix, token_feed=self.token_feed, teacher_top=reference, ranks=width,
                levers=self.eval_tree)
            if real:
                totals.add(out)
                cover += torch.stack(out["cover_sums"])
                by_rank += torch.stack(ranked["rank_counts"])
        self.model.train()
        totals = totals.reduced(self.accelerator)
        by_rank, cover = (self.accelerator.reduce(t, reduction="sum").cpu() for t in (by_rank, cover))
        counts = totals.counts.clamp(min=1.0)
        accuracy = [float(totals.correct[k] / counts[k]) for k in range(steps)]
        metrics = {f"acc_{k}": a for k, a in enumerate(accuracy)}
        metrics.update({f"loss_{k}": float(totals.loss[k] / counts[k]) for k in range(steps)})
        metrics["sim_accept"] = simulated_acceptance_length(accuracy)
        reach = by_rank.sum(-1)  # per depth, the positions a tree's branch reached (a chain's: every one)
        rank_rates = [[float(by_rank[k, r] / reach[k].clamp(min=1.0)) for r in range(width)] for k in range(steps)]
        if self.eval_tree is not None:
            metrics.update({f"reach_{k}": float(reach[k] / counts[k]) for k in range(steps)})
        metrics["select_shape"] = self.select.spec
        metrics["select_accept"] = simulated_acceptance(self.select, rank_rates)
        metrics.update({f"rank_rate_{k}_{r}": rate for k, rates in enumerate(rank_rates) for r, rate in enumerate(rates)})
        metrics.update({f"cover_{k}": float(cover[k] / counts[k]) for k in range(steps)})
        metrics["cover_width"] = self.levers.width
        metrics["positions"] = int(totals.counts.sum())
        metrics["split"] = "heldout" if self.source.heldout_reader is not None else "train-slice"
        return metrics

    def _eval_batches(self, reader: Any) -> tuple[list, int, Any]:
        """This rank's share of the first `train.eval_batches` batches (longest first, unshuffled).

        The same global batches whatever the number of processes, so held-out figures of a
        1-process and an N-process run agree; returns (this rank's index arrays, rounds, a spare
        batch for ranks with fewer).
        """
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
        """Save a step checkpoint (every rank takes part), or only the draft into `best/`.

        A failed write (a full disk) removes the half-written directory and stops with the fix;
        the checkpoints already published are untouched.
        """
        name = "best" if best_only else ckpt.step_dir(self.ckpt_root, self.state.step).name
        partial = self.ckpt_root / f"{name}.partial"
        try:
            return self._write_checkpoint(name, partial, best_only)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            last = ckpt.latest_checkpoint(self.ckpt_root)
            raise EyasError(f"cannot write the checkpoint '{self.ckpt_root / name}': {exc.strerror or exc}. "
                            f"Nothing saved before is lost (newest complete checkpoint: {last or 'none'}); free disk "
                            "space and run the same command again to resume") from None

    def _write_checkpoint(self, name: str, partial: Path, best_only: bool) -> Path:
        acc = self.accelerator
        final = self.ckpt_root / name
        self.rank_zero.run("checkpoint's fresh directory", lambda: fresh_partial(final))
        state_dict = head_state(saved_weights(acc, self.model, self.frozen_fp32))
        meta = {"step": self.state.step, "eval": self.state.last_eval, "run": self.recipe.run.name,
                "tokens": self.state.tokens, "train_steps": self.train_steps, "ttt_steps": self.cfg.ttt_steps}
        if best_only:  # what chose it
            meta["selected_by"] = {"shape": self.state.best_by, "simulated_acceptance": self.state.best_score,
                                   "on": self.state.last_eval.get("split")}
        else:
            acc.save_state(str(partial / "state"))
            rng = partial / "state" / f"random_states_{acc.process_index}.pkl"
            ckpt.write_json(partial / f"loader_rank{acc.process_index}.json",
                            {**self.position, "rng_sha256": sha256_file(rng) if rng.is_file() else None})
        self.rank_zero.run("draft's save", lambda: self._write_main_files(partial, best_only, meta, state_dict))
        acc.wait_for_everyone()  # every rank's files are written before they are signed
        self.rank_zero.run("checkpoint's signing and publishing", lambda: self._publish(partial, final, best_only))
        return final

    def _write_main_files(self, partial: Path, best_only: bool, meta: dict, state_dict: dict) -> None:
        save_draft(partial, self.head, meta, state_dict)
        if not best_only:
            ckpt.write_json(partial / ckpt.TRAINER_FILE, {
                **self.state.to_dict(), "scheduler": self.scheduler.state_dict(),
                "world_size": self.accelerator.num_processes, "head_config": self.head_config.to_dict(),
                "train": dataclasses.asdict(self.cfg), "seed": self.recipe.run.seed, "total_steps": self.total_steps})

    def _publish(self, partial: Path, final: Path, best_only: bool) -> None:
        if not best_only:  # sign what a resume reads (eyas.train.trust)
            trust.sign_checkpoint(partial)
        publish_dir(partial, final)
        if not best_only:
            ckpt.prune_checkpoints(self.ckpt_root, self.cfg.keep_last)

    def resume(self) -> None:
        """Restore everything from the newest complete checkpoint, if resuming is on and there is one."""
        latest = self.resume_from
        if latest is None:
            return
        saved = ckpt.read_trainer_state(latest)
        diffs = self.head_config.resume_differences(saved["head_config"])
        if diffs:
            raise EyasError(f"cannot resume from '{latest}': the checkpoint's draft differs from this run's ("
                            + "; ".join(diffs) + "); set train.resume=false or use another run.name")
        # every rank stands at the same position at a step boundary; on another number of processes
        # rank 0's is converted (TokenBudgetLoader.load_state_dict)
        position_file = latest / f"loader_rank{0 if self.processes_changed else self.accelerator.process_index}.json"
        if not (latest / "state").is_dir() or not position_file.is_file():
            raise EyasError(f"'{latest}' lacks its training state (state/ or {position_file.name}); "
                            "delete it to resume from the one before")
        changes = self._settings_on_resume(saved, latest)
        position = json.loads(position_file.read_text())
        self._check_rng_state(latest)
        # before anything is unpickled; hashing reads the whole state once (seconds per GB of a DeepSpeed state)
        trust.verify_before_load(self.rank_zero, latest, self.cfg.trust_checkpoint)
        self._load_state(latest / "state")
        self.scheduler.load_state_dict(saved["scheduler"])
        if changes:
            self._apply_changed_settings()
        self.resume_changes = changes
        self.loader.load_state_dict(position)
        self.position = self.loader.state_dict()
        # checkpoints from before train.select_shape chose by the chain figure over the unroll's steps
        best_by = saved.get("best_by", f"chain:{self.eval_steps}")
        best_score = saved.get("best_score", saved.get("best_sim_accept", -1.0))
        if best_by != self.select.spec:  # another figure chose best/: the next held-out eval replaces it
            self.reselect = (best_by, self.select.spec)
            best_score = -1.0
        self.state = TrainState(step=saved["step"], tokens=saved["tokens"], best_score=best_score, best_by=best_by,
                                best_step=saved["best_step"], last_eval=saved.get("last_eval", {}))
        self.resumed_from = latest

    def _load_state(self, state: Path) -> None:
        """accelerate's load_state; on another number of processes a DeepSpeed state is read through a
        universal copy (DeepSpeed refuses to repartition its own format), made once by the main process."""
        acc = self.accelerator
        if not (self.processes_changed and getattr(acc.state, "deepspeed_plugin", None)):
            acc.load_state(str(state))
            return
        universal = self.ckpt_root / f".universal-{state.parent.name}"
        self.rank_zero.run("conversion of the DeepSpeed state to a universal one",
                           lambda: ckpt.universal_state(state, universal))
        acc.load_state(str(universal))
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(universal, ignore_errors=True)

    def _check_rng_state(self, latest: Path) -> None:
        """accelerate skips an unreadable RNG state with a log line, and the resume is no longer exact.

        On another number of processes a rank the checkpoint had keeps its state and a new rank has
        none; nothing in a training step draws random numbers (the data order is seeded by the
        recipe), so that changes nothing but the random state a later user of it would see."""
        rank = self.accelerator.process_index
        rng = latest / "state" / f"random_states_{rank}.pkl"
        position_file = latest / f"loader_rank{rank}.json"
        if self.processes_changed and not position_file.is_file():
            return
        expected = json.loads(position_file.read_text()).get("rng_sha256")
        if expected is None:  # written before checkpoints recorded it
            return
        if not rng.is_file() or sha256_file(rng) != expected:
            raise EyasError(f"the random state of rank {rank} in '{latest}' is missing or damaged (checksum differs), so "
                            "a resume from it would not be exact; delete that checkpoint to resume from the one before, "
                            "or set train.resume=false")

    def _settings_on_resume(self, saved: dict, latest: Path) -> dict[str, tuple[Any, Any]]:
        """The changed train.* settings this resume applies; refuses the ones it cannot."""
        if "train" not in saved:  # written before checkpoints recorded their settings
            return {}
        # grad_accum follows the checkpoint's global batch (ckpt.plan_resize), never a "change"
        changes = changed_settings({**saved["train"], "grad_accum": self.cfg.grad_accum}, dataclasses.asdict(self.cfg))
        if saved.get("seed", self.recipe.run.seed) != self.recipe.run.seed:
            changes["run.seed"] = (saved["seed"], self.recipe.run.seed)
        fixed = [k for k in changes if k in FIXED_ON_RESUME or k == "run.seed"]
        if fixed:
            what = "; ".join(f"{_key(k)} was {changes[k][0]!r}, now {changes[k][1]!r}" for k in fixed)
            raise EyasError(f"cannot resume from '{latest}': {what}. These fix the data order and the saved state; "
                            "set them back to resume, or start over with train.resume=false (or another run.name)")
        return changes

    def _apply_changed_settings(self) -> None:
        """After load_state restored the saved optimizer: this recipe's lr, schedule, betas and decay."""
        set_optimizer_settings(self.optimizer, self.cfg)
        scheduler = self.scheduler
        scheduler.base_lrs = [self.cfg.lr for _ in self.optimizer.param_groups]
        for group, base, factor in zip(self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # -- the loop

    def run(self, stop_at_step: int | None = None) -> dict:
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
            f"TTT {self.train_steps} step(s)"
            + (f" (ramped from 1 over {cfg.ttt_ramp_steps} steps)" if cfg.ttt_ramp_steps and self.train_steps > 1 else "")
            + f"; {self.init_note}; {self.source.description}; device {self.device}, "
            f"mixed precision {acc.mixed_precision}"
            + (f"; resumed from {self.resumed_from} (step {self.state.step})" if self.resumed_from else ""))
        if self.resumed_from and self.resize:
            logger.message(f"eyas train: {self.resize.describe()}")
        if self.resumed_from and self.reselect:
            logger.message(f"eyas train: best/ was chosen by the simulated acceptance of {self.reselect[0]}; the next "
                           f"held-out eval chooses by {self.reselect[1]} (train.select_shape)")
        if self.resumed_from and self.resume_changes:
            logger.message("eyas train: resumed with changed settings, applied from this step on: " + ", ".join(
                f"{_key(k)} {old!r} -> {new!r}" for k, (old, new) in self.resume_changes.items()))
        signals = StopSignals().install()
        stream = BatchStream(self.loader, cfg.prefetch, cfg.loader_workers, decode_in_reader=self.device.type == "cpu")
        outcome = "done"
        try:
            while self.state.step < self.total_steps:
                micro = [next(stream) for _ in range(cfg.grad_accum)]
                done = self.train_step(micro)
                self.position = micro[-1][1]
                self.state.step += 1
                self.unread_tokens += done.totals.tokens.long()  # this process's, on the device until the next read
                logger.advance(1)
                step = self.state.step
                last = step == self.total_steps
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
                        break
        finally:
            stream.close()
            signals.restore()
            logger.close()
            if self.source.features is not None:
                self.source.features.close()
        return {"step": self.state.step, "outcome": outcome, "checkpoint": ckpt.latest_checkpoint(self.ckpt_root),
                "best": ckpt.best_checkpoint(self.run_dir), "best_score": self.state.best_score,
                "best_by": self.state.best_by,
                "last_eval": self.state.last_eval, "main_process_seconds": dict(self.rank_zero.seconds)}

    def _count_tokens(self, logger: Any) -> None:
        """Add the tokens of the steps since the last read (every process's: a collective) to the state and the rates."""
        tokens = int(self.accelerator.reduce(self.unread_tokens[None], reduction="sum"))
        self.unread_tokens.zero_()
        self.state.tokens += tokens
        logger.advance(0, tokens)

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
                       f"{metrics['sim_accept']:.3f} (chain), {metrics['select_accept']:.3f} ({self.select.spec}), "
                       "accuracy per step " + " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.eval_steps)))
        if metrics["select_accept"] > self.state.best_score:
            self.state.best_score, self.state.best_by = metrics["select_accept"], self.select.spec
            self.state.best_step = self.state.step
            self.save(best_only=True)


def _key(name: str) -> str:
    return name if "." in name else f"train.{name}"


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
