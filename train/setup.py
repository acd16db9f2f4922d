"""What one training run is built from (`Setup`), and `set_up`, which builds it from a recipe.

Built in named steps: the target's identity, the accelerator (and a resume's split of the saved global
batch), the fit check, the data source, the head, the teacher, the loader and optimizer, accelerate's
wrapping of the training unroll, then the schedule. Nothing in a `Setup` is replaced once built; the
objects in it keep their own state (weights, optimizer moments, the loader's position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from eyas.draft.head import DraftHead, count_parameters, init_layers_from_target
from eyas.draft.registry import build_head, head_class
from eyas.errors import EyasError
from eyas.recipe_checks import check_against_target, parse_loss_mix, selected_shape, tree_width
from eyas.recipe_kinds import reads_drafted_tokens, token_feed
from eyas.recipe_schema import Recipe
from eyas.shapes import Shape, ranks_needed
from eyas.targets import load_target_config, load_tokenizer, target_identity
from eyas.train import checkpoint as ckpt
from eyas.train.accelerator import configure_deepspeed, frozen_originals, make_accelerator
from eyas.train.data import read_target_layer, read_target_weights
from eyas.train.loader import TokenBudgetLoader, make_loader
from eyas.train.losses import Teacher
from eyas.train.memory import dense_attention_reason, refuse_if_too_big, sharding_of
from eyas.train.optimizer import count_steps, make_optimizer, make_schedule
from eyas.train.rank_zero import RankZeroWork
from eyas.train.source import Source, closed_on_error, open_source
from eyas.train.ttt import TrainingUnroll, TreeLevers


@dataclass(frozen=True)
class Setup:
    """The parts of one run. `recipe` is the run's, its train.grad_accum as a resume's `resize` set it."""

    recipe: Recipe
    accelerator: Accelerator
    rank_zero: RankZeroWork        # the main process's work (publishing checkpoints), bounded by train.dist_timeout_s
    resume_from: Path | None       # the newest checkpoint, where train.resume is on and there is one
    resize: ckpt.Resize | None     # how that resume splits the saved global batch over this run's processes
    source: Source
    head_config: Any
    init_note: str                 # how the head's layers were initialised (the run's first line says it)
    param_counts: tuple[int, int]  # (trainable, total), counted before ZeRO-3 partitions the weights
    teacher: Teacher
    mix: dict[str, float]          # train.loss: each loss's weight
    token_feed: str
    levers: TreeLevers
    select: Shape                  # `best/` is the checkpoint whose held-out simulated acceptance of this shape is highest
    select_width: int
    eval_tree: TreeLevers | None   # the held-out eval's tree pass (None: the selected shape is a chain)
    train_steps: int               # the unroll's depth in training (EAGLE-1: one step)
    weights: list[float]           # each unrolled step's loss weight, train.ttt_decay ** k
    loader: TokenBudgetLoader
    total_steps: int
    frozen_fp32: dict[str, torch.Tensor]  # `frozen_originals`, for the checkpoints' drafts
    model: Any                     # accelerate's wrapping of the TrainingUnroll
    optimizer: Any                 # the one `prepare` returned
    scheduler: Any

    @property
    def cfg(self) -> Any:
        return self.recipe.train

    @property
    def kind(self) -> str:
        return self.recipe.draft.kind

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def run_dir(self) -> Path:
        return self.recipe.run_dir

    @property
    def ckpt_root(self) -> Path:
        return self.recipe.run_dir / "checkpoints"

    @property
    def eval_steps(self) -> int:
        """The held-out eval's unroll depth, the full one (where EAGLE-1 trains one step)."""
        return self.cfg.ttt_steps

    @property
    def processes_changed(self) -> bool:
        return bool(self.resize and self.resize.processes_changed)

    @property
    def head(self) -> DraftHead:
        return self.accelerator.unwrap_model(self.model).head


def set_up(recipe: Recipe, target_model: Any = None, fit_check: Callable[..., None] = refuse_if_too_big) -> Setup:
    """The run's parts. `target_model`: an already loaded target; `fit_check`: refuses a recipe too big for the GPU."""
    kind_class = head_class(recipe.draft.kind)
    target_config, identity = check_target(recipe, target_model)
    # EAGLE-1 trains one step (plus its feature regression); the held-out eval unrolls the full depth
    train_steps = kind_class.unroll_steps(recipe.train.ttt_steps)
    select = selected_shape(recipe)
    # per-step layers past the unroll depth get no gradient while the depth ramps up (an unroll
    # shorter than an mtp draft's layers is refused by check_against_target)
    unused = kind_class.layout.weights_per_step and recipe.train.ttt_ramp_steps > 0
    accelerator = make_accelerator(recipe, find_unused=unused)
    rank_zero = RankZeroWork(accelerator, recipe.train.dist_timeout_s)
    resume_from = ckpt.latest_checkpoint(recipe.run_dir / "checkpoints") if recipe.train.resume else None
    resize = ckpt.plan_resize(resume_from, accelerator.num_processes, recipe.train.grad_accum)
    if resize:  # before anything sizes itself by grad_accum: the loader, the schedule, DeepSpeed
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, grad_accum=resize.accum))
        accelerator.gradient_accumulation_steps = resize.accum
    cfg, device = recipe.train, accelerator.device
    if device.type == "cuda":  # a recipe that cannot fit is refused now, before the target and the data load
        fit_check("train", recipe, target_config, torch.cuda.get_device_properties(device).total_memory,
                  accelerator.num_processes, sharding_of(accelerator), accelerator.mixed_precision,
                  dense_attention_reason(train_steps, accelerator, target_config))
    source = open_source(recipe, target_config, identity, device, target_model)
    with closed_on_error(source):  # a streamed source's engines stop if what follows fails
        head, lm_head, init_note = seeded_head(recipe, target_config, target_model, source, identity)
        head_config = head.config
        teacher = make_teacher(accelerator, head, lm_head, source, cfg.teacher_chunk)
        mix, feed = parse_loss_mix(cfg.loss), token_feed(recipe)
        levers = TreeLevers(tree_width(recipe), follow=cfg.sibling_feed, align=cfg.align_mask)
        # the held-out eval measures a tree's rates in a second pass beside the chain's: along the branch the tree
        # continues (where the unroll reads its drafted tokens), each depth's over the positions the branch reached
        # (the align mask's reach: a verify stops where the target's token is outside the tree's width)
        select_width = ranks_needed(select)
        eval_tree = TreeLevers(select_width, follow=reads_drafted_tokens(recipe), align=True) if select_width > 1 else None
        loader = make_loader(recipe, accelerator, source.train_reader, shuffle=True)
        total_steps = count_steps(cfg, len(loader), accelerator.num_processes)
        optimizer = make_optimizer(head, cfg)
        param_counts = count_parameters(head)  # before ZeRO-3 partitions the weights
        configure_deepspeed(accelerator, cfg, load_universal=bool(resize and resize.processes_changed))
        frozen_fp32 = frozen_originals(accelerator, head)  # before DeepSpeed's cast
        model, optimizer = accelerator.prepare(TrainingUnroll(head.to(device), checkpoint_steps=cfg.checkpoint_unroll), optimizer)
        scheduler = make_schedule(optimizer, cfg, total_steps)
        return Setup(recipe=recipe, accelerator=accelerator, rank_zero=rank_zero, resume_from=resume_from, resize=resize,
                     source=source, head_config=head_config, init_note=init_note, param_counts=param_counts, teacher=teacher,
                     mix=mix, token_feed=feed, levers=levers, select=select,
                     select_width=select_width, eval_tree=eval_tree, train_steps=train_steps,
                     weights=[cfg.ttt_decay ** k for k in range(train_steps)], loader=loader, total_steps=total_steps,
                     frozen_fp32=frozen_fp32, model=model, optimizer=optimizer, scheduler=scheduler)


def check_target(recipe: Recipe, target_model: Any) -> tuple[Any, str]:
    """The target's config, checked against the recipe, and the target's identity."""
    if target_model is not None:
        target_config = target_model.config
    else:
        target_config = load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
    check_against_target(recipe, target_config)
    return target_config, target_identity(target_config, load_tokenizer(recipe.target))


def seeded_head(recipe: Recipe, target_config: Any, target_model: Any, source: Source,
                identity: str) -> tuple[DraftHead, torch.Tensor, str]:
    """A seeded new head with the target's embedding, lm_head and final norm copied in; its lm_head; how it was initialised."""
    set_seed(recipe.run.seed)
    head = build_head(recipe.draft, target_config, source.aux_layers, source.d2t, identity)
    embed, lm_head, norm = target_weights(recipe, source, target_model)
    head.init_from_target_weights(embed, lm_head, norm)
    if recipe.train.draft_init != "target_last_layer":
        return head, lm_head, "random init"
    model = target_model if target_model is not None else getattr(source.features, "model", None)
    index, tensors = read_target_layer(recipe.target.path, recipe.target.trust_remote_code, model)
    copied, kept = init_layers_from_target(head, tensors)
    if not copied:
        raise EyasError(f"train.draft_init=target_last_layer: no tensor of the target's layer {index} fits the "
                        f"{recipe.draft.kind} head (kept: {', '.join(kept[:4])}); use train.draft_init=random")
    return head, lm_head, (f"layer(s) from target layer {index}: {len(copied)} tensors copied, {len(kept)} random"
                           + (f" ({', '.join(kept)})" if kept else ""))


def target_weights(recipe: Recipe, source: Source, target_model: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The target's embedding, lm_head and final norm (None where it has none), from a loaded target or its files."""
    if target_model is not None:
        base = getattr(target_model, "model", target_model)
        norm = base.norm.weight.detach().float() if hasattr(base, "norm") else None
        return (target_model.get_input_embeddings().weight.detach().float(),
                target_model.get_output_embeddings().weight.detach().float(), norm)
    if source.features is not None:
        return target_weights(recipe, source, source.features.model)
    return read_target_weights(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)


def make_teacher(accelerator: Any, head: DraftHead, lm_head: torch.Tensor, source: Source, chunk: int) -> Teacher:
    bf16_cuda = accelerator.mixed_precision == "bf16" and accelerator.device.type == "cuda"
    return Teacher(lm_head, source.d2t if head.d2t is not None else None, chunk,
                   torch.bfloat16 if bf16_cuda else torch.float32, accelerator.device)
