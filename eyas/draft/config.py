"""`HeadConfig`: everything needed to rebuild a draft head without its target.

It is written as a draft directory's `config.json` (with a `meta` block beside it, see
`eyas.draft.checkpoint`) and read back by eval, export and resume. The schema is versioned:
`FORMAT_VERSION` is bumped on any change an older reader could not follow, and a config
written by a newer eyas is refused with the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eyas.draft.registry import KINDS, kind_rules
from eyas.errors import EyasError

FORMAT = "eyas-draft"
# The newest format this eyas reads. 2 added EAGLE-3's normalisation variants (`norm_before_fc`,
# `norm_before_residual`): a config is written with the lowest version that describes it
# (`HeadConfig.written_version`), so a head without them stays version 1 and an eyas from before
# them still reads it, while a variant head (which such an eyas would build without its extra norm,
# or with the wrong residual) is refused there with "upgrade eyas". 3 added `kind_options` (the shape
# settings of a kind that has its own, such as DSpark's Markov rank), written only when a head has some.
FORMAT_VERSION = 3

# Families whose q/k/v projections always carry a bias although their config has no
# `attention_bias` field (transformers hard-codes it).
_QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe", "qwen2_vl")

# Fields that must agree for a resume (or a warm start) to make sense.
RESUME_FIELDS = ("kind", "num_layers", "mtp_feed", "aux_layers", "hidden_size", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                 "target_identity", "norm_before_fc", "norm_before_residual", "kind_options")


@dataclass
class HeadConfig:
    """A head's shapes and provenance; `to_dict()` is the on-disk `config.json` (minus `meta`)."""

    kind: str
    num_layers: int
    num_steps: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=dict)
    mtp_feed: str = "target"
    aux_layers: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    initializer_range: float = 0.02
    target_model_type: str = ""
    target_hidden_layers: int = 0
    tie_word_embeddings: bool = False
    target_identity: str = ""
    train_lm_head: bool = False
    # eagle3 only, EAGLE-3's normalisation variants that vLLM serves (its speculators config flags of
    # the same names); False is the layout every config before them has.
    # norm_before_fc: an RMSNorm (`input_norm`, 3H wide) over the three fused target layers before `fc`.
    norm_before_fc: bool = False
    # norm_before_residual: the layer's residual stream is hidden_norm(feature) instead of the feature.
    norm_before_residual: bool = False
    # dflash only: the token whose embedding row the mask slots carry (a trained `mask_embedding` replaces it)
    mask_token_id: int = -1
    # dflash only: whether `mask_embedding` trains (False: it stays the target's row of mask_token_id)
    train_mask_embedding: bool = True
    # the shapes of a kind's own modules, by name, for a kind that has any (dspark: {"markov_rank": 256}); a kind
    # reads its own from here and every other reader carries them through unread
    kind_options: dict = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def reduced_vocab(self) -> bool:
        """Whether the head predicts over a reduced draft vocabulary (d2t/t2d maps)."""
        return self.draft_vocab_size != self.vocab_size

    def __post_init__(self) -> None:
        # the version this config is written as; derived, so a read-back or replaced config compares equal
        self.format_version = self.written_version

    @property
    def variants(self) -> list[str]:
        """The normalisation variants this head has on (empty for the EAGLE-3 layout of the paper)."""
        return [name for name in variant_fields() if getattr(self, name)]

    @property
    def written_version(self) -> int:
        """The lowest format version that describes this head (see FORMAT_VERSION)."""
        if self.kind_options:
            return 3
        return 2 if self.variants else 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "config.json") -> HeadConfig:
        """Read a saved config (a `meta` block and unknown keys of a future minor version are ignored)."""
        if data.get("format") != FORMAT:
            raise EyasError(f"'{where}' is not an eyas draft config (no format '{FORMAT}'); point at a checkpoint "
                            "written by `eyas train`")
        if int(data.get("format_version", 0)) > FORMAT_VERSION:
            raise EyasError(f"'{where}' was written by a newer eyas (draft format {data['format_version']}, this "
                            f"eyas reads up to {FORMAT_VERSION}); upgrade eyas")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise EyasError(f"'{where}' lacks {', '.join(missing)}; the checkpoint is damaged")
        values = {k: v for k, v in data.items() if k in names}
        values.setdefault("train_lm_head", kind_rules(str(data.get("kind"))).trains_lm_head)  # configs from before the field
        config = cls(**values)
        own = {v.field for v in kind_rules(config.kind).variants}
        foreign = [name for name in config.variants if name not in own]
        if foreign:
            owners = [kind for kind in KINDS if any(v.field == foreign[0] for v in kind_rules(kind).variants)]
            raise EyasError(f"'{where}' is a {config.kind} draft with {', '.join(foreign)} set, which only "
                            f"{' or '.join(f'an {k}' for k in owners)} head has; the config was edited by hand or is damaged")
        return config

    def resume_differences(self, other: HeadConfig | dict) -> list[str]:
        """What differs from `other` (a saved config) in the fields a resume depends on."""
        saved = other.to_dict() if isinstance(other, HeadConfig) else dict(other)
        for f in dataclasses.fields(self):  # a field newer than the checkpoint reads as its default, as from_dict does
            if f.name not in saved and f.default is not dataclasses.MISSING:
                saved[f.name] = f.default
        mine = self.to_dict()
        return [f"{key}: checkpoint {saved.get(key)!r} vs this run {mine.get(key)!r}"
                for key in RESUME_FIELDS if saved.get(key) != mine.get(key)]


def variant_fields() -> tuple[str, ...]:
    """Every variant field any kind has, in registry order (HeadConfig fields; imports every kind's module)."""
    return tuple(v.field for kind in KINDS for v in kind_rules(kind).variants)


def rope_parameters(target_config: Any) -> dict:
    """The target's RoPE settings as transformers >= 5 normalises them (theta + scaling)."""
    params = getattr(target_config, "rope_parameters", None)
    if params:
        params = dict(params)
        if "rope_theta" not in params and getattr(target_config, "rope_theta", None) is not None:
            params["rope_theta"] = float(target_config.rope_theta)
        return params
    params = {"rope_type": "default", "rope_theta": float(getattr(target_config, "rope_theta", 10000.0))}
    scaling = getattr(target_config, "rope_scaling", None)
    if scaling:
        params.update(scaling)
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return params


def text_config(target_config: Any) -> Any:
    """The language-model part of a (possibly multimodal) target config."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def target_shapes(target_config: Any) -> dict:
    """The HeadConfig fields a head copies from its target (sizes, attention layout, RoPE, provenance)."""
    text = text_config(target_config)
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    model_type = str(getattr(text, "model_type", ""))
    attention_bias = bool(getattr(text, "attention_bias", False))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(text.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
        "hidden_act": str(getattr(text, "hidden_act", "silu")),
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
        "qkv_bias": attention_bias or model_type in _QKV_BIAS_FAMILIES,
        "o_bias": attention_bias,
        "rope_parameters": rope_parameters(text),
        "max_position_embeddings": int(text.max_position_embeddings),
        "initializer_range": float(getattr(text, "initializer_range", 0.02)),
        "vocab_size": int(text.vocab_size),
        "target_model_type": model_type,
        "target_hidden_layers": int(text.num_hidden_layers),
        "tie_word_embeddings": bool(getattr(target_config, "tie_word_embeddings", False)),
    }
