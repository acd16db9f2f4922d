"""The head kinds eyas trains: one line per kind (how to add one: docs/heads.md, "Adding a head kind")."""

from __future__ import annotations

from typing import Any

import torch

from eyas.config import default_layers
from eyas.draft.config import HeadConfig
from eyas.draft.dflash import DFlashHead
from eyas.draft.eagle import EagleHead
from eyas.draft.eagle3 import Eagle3Head
from eyas.draft.head import DraftHead
from eyas.draft.mtp import MTPHead
from eyas.draft.peagle import PEagleHead
from eyas.errors import EyasError

HEADS: dict[str, type[DraftHead]] = {
    "eagle": EagleHead,
    "eagle3": Eagle3Head,
    "mtp": MTPHead,
    "peagle": PEagleHead,
    "dflash": DFlashHead,
}
KINDS = tuple(HEADS)


def head_class(kind: str) -> type[DraftHead]:
    try:
        return HEADS[kind]
    except KeyError:
        raise EyasError(f"draft.kind '{kind}' is not one of {', '.join(KINDS)}") from None


def uses_draft_vocab(draft_cfg: Any) -> bool:
    """Whether a head of this recipe predicts over the reduced draft vocabulary (d2t/t2d)."""
    return head_class(draft_cfg.kind).supports_draft_vocab and bool(draft_cfg.use_draft_vocab)


def build_head(draft_cfg: Any, target_config: Any, aux_layers: list[int] | None = None,
               d2t: torch.Tensor | None = None, target_identity: str = "") -> DraftHead:
    """A new head for a recipe's `draft` section, shaped on `target_config`.

    `d2t` (draft id -> offset to target id) selects the reduced draft vocabulary of kinds that
    support one; it is ignored otherwise and when `draft.use_draft_vocab` is false.
    """
    cls = head_class(draft_cfg.kind)
    if cls.feature_spec.fused_layers and not aux_layers:
        aux_layers = default_layers(int(target_config.num_hidden_layers))
    use_vocab = uses_draft_vocab(draft_cfg) and d2t is not None
    cfg = cls.head_config(draft_cfg, target_config, aux_layers, len(d2t) if use_vocab else None, target_identity)
    return cls(cfg, d2t if cfg.reduced_vocab else None)


def head_from_config(cfg: HeadConfig | dict, d2t: torch.Tensor | None = None, where: str = "config.json"
                     ) -> DraftHead:
    """Rebuild a head from a saved config (a HeadConfig, or the dict of a config.json)."""
    if isinstance(cfg, dict):
        cfg = HeadConfig.from_dict(cfg, where)
    return head_class(cfg.kind)(cfg, d2t)
