"""The accelerate side of a run: the `Accelerator` for the launcher's setup, the DeepSpeed values eyas owns, and
the fp32 weights a checkpoint saves where DeepSpeed casts the module itself (`module_cast`)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration

from eyas.cpus import threads_per_process
from eyas.draft.head import DraftHead
from eyas.precision import mixed_precision_for
from eyas.recipe_schema import Recipe
from eyas.train.metrics import tracker_settings


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
