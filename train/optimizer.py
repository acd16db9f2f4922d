"""The optimizer and its schedule: AdamW with weight decay on matrices only, warmup then cosine to a floor."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from eyas.draft.head import DraftHead
from eyas.errors import EyasError


def count_steps(cfg: Any, batches: int, processes: int) -> int:
    """The run's optimizer steps, which its warmup + cosine schedule spans: train.max_steps, else train.epochs' worth."""
    if batches == 0:
        raise EyasError(f"the training data gives no batch to each of {processes} process(es); "
                        "use more data or a smaller train.token_budget")
    return cfg.max_steps or max(1, math.ceil(cfg.epochs * batches / cfg.grad_accum))


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


def make_schedule(optimizer: torch.optim.Optimizer, cfg: Any, total_steps: int) -> Any:
    """Warmup, then cosine down to `train.min_lr_ratio` of the peak, over the run's optimizer steps. Built on the
    optimizer accelerate's `prepare` returned: FSDP and ZeRO put their own (sharded) parameters in its groups."""
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps, min_lr_rate=cfg.min_lr_ratio)
