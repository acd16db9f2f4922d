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
    variants: tuple[Variant, ...] = ()
    # one layer (mtp) or block slot (dflash) per draft step, each trained only by its own step:
    # train.ttt_steps defaults to, and must equal, draft.num_steps
    unroll_per_layer: bool = False
    step_unit: str = "layers"  # what draft.num_steps counts, as messages name it
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
    "mtp": KindRules(title="MTP", unroll_per_layer=True),
    # one forward drafts the block; the unroll's step k is the block's mask slot k+1, num_steps slots
    # EAGLE-3 drafting its steps from mask slots, all in one forward (eyas/draft/peagle.py)
    "peagle": KindRules(title="P-EAGLE", trains_lm_head=True, attention_bias_from_target=False),
    "dflash": KindRules(title="DFlash", unroll_per_layer=True, step_unit="mask slots", trains_lm_head=True,
                        mask_vector=True),
}


def kind_rules(kind: str) -> KindRules:
    """The rules of `kind` (a plain head's for a name no kind has: the recipe's choice check names it)."""
    return KIND_RULES.get(kind, KindRules())


def variant_fields() -> tuple[str, ...]:
    """Every variant field any kind has, in declaration order (HeadConfig fields)."""
    return tuple(v.field for rules in KIND_RULES.values() for v in rules.variants)
