"""What the recipe and the head config need to know about each head kind, without importing torch.

`eyas.config` checks a recipe when it loads (`eyas --help`, a bad key, `eyas plan`, a SLURM
submission on a login node), and `eyas.draft.config` reads a saved config.json; neither may pay
for importing torch and transformers, so a kind's rules about recipes live here as data, one
entry per kind beside its module `eyas/draft/<kind>.py`. Everything else a kind is (layers,
feature spec, export mapping) lives in that module; `tests/test_draft_plugins.py` checks that
every registered kind has an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.draft.layouts import BLOCK, LAYER_PER_STEP, PARALLEL_SLOTS, SHARED_LAYER, Layout
from eyas.errors import EyasError

# Display names of the serving engines, by export format.
ENGINES = {"sglang": "SGLang", "vllm": "vLLM"}


@dataclass(frozen=True)
class Variant:
    """A layer variant a kind can be trained with, and the export formats whose engine builds it."""

    field: str  # the HeadConfig field (and the engine config flag of the same name)
    recipe_key: str  # the recipe's `draft.<recipe_key>` switch
    formats: tuple[str, ...]  # formats whose draft model builds it; any other would serve another network


@dataclass(frozen=True)
class KindRules:
    """A kind's rules about recipes and saved configs (the defaults are a plain one-layer head)."""

    title: str = ""  # how messages name the kind's architecture ("EAGLE-3")
    # how it drafts (eyas.draft.layouts): what every stage builds for it
    layout: Layout = SHARED_LAYER
    variants: tuple[Variant, ...] = ()
    # trains its lm_head unless `draft.train_lm_head: false` (configs from before that field: this value)
    trains_lm_head: bool = False
    # its mask slots carry a vector of their own (`mask_embedding`), trained unless `draft.train_mask_embedding: false`
    mask_vector: bool = False
    # its layers carry the target's attention biases (a layer shaped as the target's, which mtp and dflash can
    # start from); False: a fresh layer, bias-free as both engines build the EAGLE-3 layer whatever the target
    attention_bias_from_target: bool = True


KIND_RULES: dict[str, KindRules] = {
    "eagle": KindRules(title="EAGLE-1"),
    # vLLM's EAGLE-3 model builds both variants under speculators config flags of these names;
    # SGLang's LlamaForCausalLMEagle3 builds neither (eyas/draft/eagle3.py)
    "eagle3": KindRules(title="EAGLE-3", trains_lm_head=True, attention_bias_from_target=False, variants=(
        Variant("norm_before_fc", "eagle3_norm_before_fc", ("vllm",)),
        Variant("norm_before_residual", "eagle3_norm_before_residual", ("vllm",)))),
    "mtp": KindRules(title="MTP", layout=LAYER_PER_STEP),
    # EAGLE-3 drafting its steps from mask slots, all in one forward (eyas/draft/peagle.py)
    "peagle": KindRules(title="P-EAGLE", layout=PARALLEL_SLOTS, trains_lm_head=True, attention_bias_from_target=False),
    # one forward drafts the block; the unroll's step k is the block's mask slot k+1, num_steps slots
    "dflash": KindRules(title="DFlash", layout=BLOCK, trains_lm_head=True, mask_vector=True),
}


def kind_rules(kind: str) -> KindRules:
    """The rules of `kind` (a plain head's for a name no kind has: the recipe's choice check names it)."""
    return KIND_RULES.get(kind, KindRules())


def variant_fields() -> tuple[str, ...]:
    """Every variant field any kind has, in declaration order (HeadConfig fields)."""
    return tuple(v.field for rules in KIND_RULES.values() for v in rules.variants)


def check_draft_section(draft: Any, export_to: str) -> None:
    """The recipe's kind-only `draft` keys, each for its own kind: a layer variant for its kind and for the
    export formats that serve it, a frozen mask vector for a kind that has one."""
    for owner, rules in KIND_RULES.items():
        for variant in rules.variants:
            key = variant.recipe_key
            if not getattr(draft, key, False):
                continue
            if owner != draft.kind:
                raise EyasError(f"recipe key 'draft.{key}' is true, but draft.kind is '{draft.kind}': it is an "
                                f"{rules.title} layer variant; set draft.kind={owner} or draft.{key}=false")
            if export_to not in variant.formats:  # refused before training, not after it at the export stage
                serves = variant.formats[0]
                raise EyasError(f"recipe key 'draft.{key}' is true, but export.to is '{export_to}', whose "
                                f"{rules.title} model has no such variant; set export.to={serves} ({ENGINES[serves]} "
                                f"serves it) or draft.{key}=false")
    own = kind_rules(draft.kind)
    if not draft.train_mask_embedding and not own.mask_vector:
        raise EyasError(f"recipe key 'draft.train_mask_embedding' is false, but a {own.title or draft.kind} "
                        "draft has no mask vector to freeze (a dflash draft has); remove the key")
