"""The types a kind declares its recipe rules and options with, and the checks of a kind's own recipe keys.

A kind's head class (`eyas/draft/<kind>.py`) carries `rules = KindRules(...)`: how messages name it,
its layer variants, whether it trains its lm_head; and, in `KindRules.options`, a dataclass of the
recipe keys that are its alone (`draft.mtp_feed`, `draft.mask_token_id`, ...), each field made with
`option` (its doc, default and checks). A recipe keeps those keys flat in its `draft` section; the
recipe reader (`eyas.recipe_kinds`) collects the ones a recipe sets into `DraftConfig.options` and checks
them here against the kind's dataclass. This module imports no torch; the checks import a kind's
module (and so torch) only for a recipe that sets one of its keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eyas.errors import EyasError

# Display names of the serving engines, by export format.
ENGINES = {"sglang": "SGLang", "vllm": "vLLM"}


@dataclass(frozen=True)
class Variant:
    """A layer variant a kind can be trained with, and the export formats whose engine builds it."""

    field: str  # the HeadConfig field (and the engine config flag of the same name)
    recipe_key: str  # the recipe's `draft.<recipe_key>` switch (an option of the kind)
    formats: tuple[str, ...]  # formats whose draft model builds it; any other would serve another network


@dataclass(frozen=True)
class KindRules:
    """A kind's rules about recipes and saved configs (the defaults are a plain one-layer head)."""

    title: str = ""  # how messages name the kind's architecture ("EAGLE-3")
    variants: tuple[Variant, ...] = ()
    # trains its lm_head unless `draft.train_lm_head: false` (configs from before that field: this value)
    trains_lm_head: bool = False
    # its layers carry the target's attention biases (a layer shaped as the target's, which mtp and dflash can
    # start from); False: a fresh layer, bias-free as both engines build the EAGLE-3 layer whatever the target
    attention_bias_from_target: bool = True
    # the dataclass of its own recipe keys (fields made with `option`); None: it has none
    options: type | None = None
    # the `train.loss` terms that score a part only its head has (eyas.recipe_schema.HEAD_LOSSES: its confidence)
    losses: tuple[str, ...] = ()


def option(doc: str, default: Any, choices: tuple = (), positive: bool = False, elsewhere: str = "") -> Any:
    """A field of a kind's options dataclass: a `draft.<name>` recipe key of that kind alone.

    `choices` / `positive`: the values it accepts. `elsewhere`: the refusal when a recipe of another kind sets it,
    after "recipe key 'draft.<name>' is <value>, but " ({title}: the recipe's kind as messages name it);
    by default the message names the kinds that have it."""
    return dataclasses.field(default=default, metadata={"doc": doc, "choices": choices, "positive": positive,
                                                        "elsewhere": elsewhere})


def option_fields(rules: KindRules) -> dict[str, dataclasses.Field]:
    """The kind's own recipe keys, by name."""
    return {f.name: f for f in dataclasses.fields(rules.options)} if rules.options else {}


def shown(value: Any) -> str:
    """A recipe value as the recipe writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def check_option(rules: KindRules, key: str, value: Any) -> None:
    """Refuse a kind option's value outside its choices or range (its type is checked by the recipe reader)."""
    meta = option_fields(rules)[key].metadata
    if meta["choices"] and value not in meta["choices"]:
        raise EyasError(f"recipe key 'draft.{key}' is {value!r}; choose one of: {', '.join(map(str, meta['choices']))}")
    if meta["positive"] and not value > 0:
        raise EyasError(f"recipe key 'draft.{key}' must be > 0, got {value!r}")


def foreign_option(kind: str, title: str, key: str, value: Any, owners: dict[str, KindRules]) -> str:
    """The refusal of `draft.<key>`, an option of the kinds `owners`, in a recipe of `kind`."""
    first, rules = next(iter(owners.items()))
    elsewhere = option_fields(rules)[key].metadata["elsewhere"]
    if elsewhere:
        return f"recipe key 'draft.{key}' is {shown(value)}, but " + elsewhere.format(title=title or kind)
    named = [f"{k} ({r.title})" if r.title else k for k, r in owners.items()]
    names = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
    return (f"recipe key 'draft.{key}' is {shown(value)}, but draft.kind is '{kind}': it is an option of {names}; "
            f"set draft.kind={first} or remove the key")


def check_variants(kind: str, rules: KindRules, options: dict[str, Any], export_to: str) -> None:
    """A layer-variant switch is for the export formats that serve it: refused before training, not at export."""
    for variant in rules.variants:
        if options.get(variant.recipe_key) and export_to not in variant.formats:
            serves = variant.formats[0]
            raise EyasError(f"recipe key 'draft.{variant.recipe_key}' is true, but export.to is '{export_to}', whose "
                            f"{rules.title} model has no such variant; set export.to={serves} ({ENGINES[serves]} "
                            f"serves it) or draft.{variant.recipe_key}=false")
