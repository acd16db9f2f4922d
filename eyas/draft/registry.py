"""The head kinds eyas trains: one line per kind (how to add one: docs/heads.md, "Adding a head kind").

A line names the module that holds the kind's head (a `DraftHead` subclass whose `kind` is the
line's key, which declares its layout, recipe rules and options, and everything the stages ask of it)
and what a recipe needs before that module is imported: its drafting layout (`eyas.draft.layouts`),
which sizes the unroll, and the defaults it gives other recipe keys. This module imports neither torch
nor a kind's module: the recipe checks (`eyas.recipe_kinds`) read every recipe with it, and pay for
importing a kind (torch, transformers: seconds) only when the recipe sets one of the kind's own keys.
So the layout is written twice, in the kind's class and on its line here, and a class that declares
another layout than its line is refused when its module is imported (`DraftHead.__init_subclass__`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from eyas.draft.features import default_layers
from eyas.draft.layouts import BLOCK, LAYER_PER_STEP, PARALLEL_SLOTS, SHARED_LAYER, Layout
from eyas.errors import EyasError

if TYPE_CHECKING:
    import torch

    from eyas.draft.head import DraftHead
    from eyas.draft.kinds import KindRules


@dataclass(frozen=True)
class Kind:
    """One registry line."""

    module: str  # holds the kind's DraftHead subclass
    layout: Layout  # the one its class declares, for the recipe checks before the module is imported
    # recipe keys ("section.key") this kind sets when the recipe does not (the kind's published training)
    recipe_defaults: dict[str, Any] = field(default_factory=dict)


KINDS: dict[str, Kind] = {
    "eagle": Kind("eyas.draft.eagle", SHARED_LAYER),
    "eagle3": Kind("eyas.draft.eagle3", SHARED_LAYER),
    "mtp": Kind("eyas.draft.mtp", LAYER_PER_STEP),
    "peagle": Kind("eyas.draft.peagle", PARALLEL_SLOTS),
    "dflash": Kind("eyas.draft.dflash", BLOCK),
    # DSpark's published training: 0.1 ce + 0.9 tv + 1.0 confidence, step k weighted exp(-k/4)
    "dspark": Kind("eyas.draft.dspark", BLOCK, {"train.loss": "ce:0.1,tv:0.9,confidence:1.0", "train.ttt_decay": 0.7788}),
}


def kind_entry(kind: str) -> Kind:
    """The registry line of `kind`, or the error naming the kinds there are."""
    try:
        return KINDS[kind]
    except KeyError:
        raise EyasError(f"draft.kind '{kind}' is not one of {', '.join(KINDS)}") from None


def head_class(kind: str) -> type[DraftHead]:
    """The head class of `kind` (imports its module: torch and transformers)."""
    return _head_class(kind, kind_entry(kind).module)


@cache
def _head_class(kind: str, module: str) -> type[DraftHead]:
    import torch  # only once a head is asked for

    # A head is the torch module that names the kind in its own class (DraftHead's subclasses; `eyas.draft.head`
    # imports this module, so the registry knows heads by what they are rather than importing it back).
    found = [value for value in vars(importlib.import_module(module)).values()
             if isinstance(value, type) and issubclass(value, torch.nn.Module) and value.__dict__.get("kind") == kind]
    if len(found) != 1:
        raise EyasError(f"module {module} should hold one DraftHead subclass with kind = '{kind}', found {len(found)}")
    return found[0]


def kind_rules(kind: str) -> KindRules:
    """The recipe rules of `kind` (its head class's `rules`; a plain head's for a name no kind has)."""
    if kind not in KINDS:
        from eyas.draft.kinds import KindRules  # torch-free: the rules type only

        return KindRules()
    return head_class(kind).rules


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
