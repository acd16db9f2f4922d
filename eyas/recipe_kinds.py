"""The kind rules of a recipe: what its `draft` section and the keys tied to the kind accept, asked of the kind.

The registry (`eyas.draft.registry`) names each kind's layout and the defaults it gives other keys without
importing the kind; its head class holds its own recipe keys (`KindRules.options`), the loss terms it scores and
its layer variants, so only a recipe that sets one of the kind's own keys, or asks what its head reads, imports the
kind's module (torch, transformers: seconds).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from eyas.draft.kinds import check_option, check_variants, foreign_option, option_fields
from eyas.draft.registry import KINDS, head_class, kind_rules
from eyas.errors import EyasError
from eyas.recipe_schema import HEAD_LOSSES, DraftConfig, Recipe, build_section, coerce, suggest


def build_draft(values: Any) -> DraftConfig:
    """The `draft` section: the keys every kind reads, and those of its kind alone (`DraftConfig.options`)."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise EyasError(f"recipe section 'draft' must be a mapping of keys, got {type(values).__name__}")
    shared = [f.name for f in dataclasses.fields(DraftConfig) if f.name != "options"]
    draft = build_section("draft", DraftConfig, {k: v for k, v in values.items() if k in shared})
    draft.options = _kind_options(draft.kind, {k: v for k, v in values.items() if k not in shared}, shared)
    return draft


def _kind_options(kind: str, keys: dict, shared: list[str]) -> dict:
    """`keys`, the draft keys outside the shared ones, checked and typed as `kind`'s options dataclass declares them.

    Only a recipe that sets such a key imports the kind's module (torch); a key of other kinds is refused naming
    them, any other as unknown."""
    if not keys or kind not in KINDS:
        return dict(keys)  # nothing to check, or a kind that does not exist, which validate() refuses by name
    rules = kind_rules(kind)
    fields = option_fields(rules)
    hints = typing.get_type_hints(rules.options) if rules.options else {}
    out = {}
    for key, value in keys.items():
        if key not in fields:
            every = {k: kind_rules(k) for k in KINDS}  # the error path only: imports every kind
            owners = {k: r for k, r in every.items() if key in option_fields(r)}
            if owners:
                raise EyasError(foreign_option(kind, rules.title, key, value, owners))
            others = [name for r in every.values() for name in option_fields(r)]
            valid = list(dict.fromkeys(shared + list(fields) + others))  # a near miss of another kind's key is named
            raise EyasError(f"unknown recipe key {f'draft.{key}'!r}: {suggest(str(key), valid)}")
        out[key] = coerce(f"draft.{key}", value, hints[key])
        check_option(rules, key, out[key])
    return out


def draft_config(**keys: Any) -> DraftConfig:
    """A `draft` section from keys as a recipe writes them, a kind's own among them (for code and tests)."""
    return build_draft(keys)


def apply_kind_defaults(recipe: Recipe, raw: dict) -> None:
    """Give the keys the recipe as written (`raw`) leaves unset what its kind sets: the unroll its layout sizes,
    and the kind's published training (`Kind.recipe_defaults`)."""
    entry = KINDS.get(recipe.draft.kind)  # None: validate() refuses the kind by name
    unroll = entry.layout.default_unroll(recipe.draft.num_steps) if entry else None
    if unroll is not None and "ttt_steps" not in (raw.get("train") or {}):
        recipe.train.ttt_steps = unroll  # a layer (slot) per step (mtp, dflash): one unroll step per layer
    for dotted, value in (entry.recipe_defaults if entry else {}).items():  # the kind's published training
        section, key = dotted.split(".")
        if key not in (raw.get(section) or {}):
            setattr(getattr(recipe, section), key, value)


def token_feed(recipe: Recipe) -> str:
    """The token an unrolled step reads: train.ttt_token_feed, `auto` resolved to the kind's own (imports the kind)."""
    feed = recipe.train.ttt_token_feed
    return head_class(recipe.draft.kind).default_token_feed if feed == "auto" else feed


def reads_drafted_tokens(recipe: Recipe) -> bool:
    """The unroll's later steps read the token the step before drafted, which a tree's sibling can replace."""
    return KINDS[recipe.draft.kind].layout.reads_drafted_token and token_feed(recipe) == "draft"


def check_head_losses(kind: str, mix: dict[str, float]) -> None:
    """Refuse a loss term for a part the kind's head lacks (imports the kind only for a recipe that names one)."""
    asked = [name for name in HEAD_LOSSES if mix.get(name)]
    if not asked or kind not in KINDS:
        return
    missing = [name for name in asked if name not in kind_rules(kind).losses]
    if missing:
        owners = [k for k in KINDS if missing[0] in kind_rules(k).losses]
        has = f"a {' or '.join(owners)} draft has one" if owners else "no kind has one"
        raise EyasError(f"recipe key 'train.loss' has a '{missing[0]}' term, but a {kind} draft has no part it "
                        f"scores ({has}); remove the term")


def check_kind_variants(recipe: Recipe) -> None:
    """A kind's layer-variant switch is for the export formats that serve it (`check_variants`)."""
    if recipe.draft.options:  # a kind's own keys: its module is imported already (`_kind_options`)
        check_variants(recipe.draft.kind, kind_rules(recipe.draft.kind), recipe.draft.options, recipe.export.to)


def check_mtp_unroll(recipe: Recipe) -> None:
    """A layer-per-step draft (mtp, dflash's slots) unrolls exactly one training step per layer (its layout's rule)."""
    kind = recipe.draft.kind
    if kind in KINDS:
        KINDS[kind].layout.check_unroll(kind, recipe.train.ttt_steps, recipe.draft.num_steps)
