"""`eagle3` (EAGLE-3): one layer over concat(embedding, fc(three fused target layers)), shared by every step.

Weight names (SGLang's LlamaForCausalLMEagle3): `embed_tokens.weight` (frozen, the target's),
`fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [V_draft, H], buffers `d2t` [V_draft] and `t2d` [V] (only with
a reduced draft vocabulary). No attention biases whatever the target (Qwen2's q/k/v, gpt-oss's q/k/v/o):
the layer is a fresh one, built as both engines build it (`KindRules.attention_bias_from_target`).

Normalisation variants (recipe keys `draft.eagle3_norm_before_fc` / `draft.eagle3_norm_before_residual`,
HeadConfig `norm_before_fc` / `norm_before_residual`), as vLLM's EAGLE-3 draft model builds them
under the speculators config flags of the same names:
- norm_before_fc: `input_norm.weight` [3H], an RMSNorm over the concatenated three target layers
  before `fc` (the three layers' scales differ a lot; one norm puts them on a common one);
- norm_before_residual: the layer's residual is hidden_norm(feature) (see `Eagle3Layer`).
SGLang's LlamaForCausalLMEagle3 has neither, so `eyas export` sends such a head to vLLM only
(the variants and the formats serving them are data in `eyas.draft.kinds`).

Export (`EXPORT`, driven by `eyas export`; the public source each format was checked against,
facts read there, no code copied):

- `--to sglang`: architecture `LlamaForCausalLMEagle3` (sglang
  `python/sglang/srt/models/llama_eagle3.py`). Weights `fc.weight` [H, 3H],
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v}_proj.weight` reading 2H (no bias: SGLang builds the fused qkv
  without one), `midlayer.self_attn.o_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (draft id -> offset to the target id;
  SGLang's hot token ids are `d2t + arange`) and `t2d` (read and skipped). Its `load_weights`
  silently skips any name it does not know, which is why the key set is checked. No
  `embed_tokens`: the EAGLE worker calls `set_embed` with the target's embedding
  (`python/sglang/srt/speculative/eagle_worker.py`). `eagle_config.eagle_aux_hidden_state_layer_ids`
  are layer *output* ids: SGLang captures the input of layer id+1 (`set_eagle3_layers_to_capture`
  in `models/llama.py`), so HF `hidden_states` index i is written as i-1. That model has no
  normalisation variants: no norm before `fc` and the residual always the raw feature (and it would
  load `input_norm.weight` by dropping it), so a head with `norm_before_fc` or
  `norm_before_residual` is refused for SGLang with the fix (export it to vLLM).
- `--to vllm`: the speculators format (vllm-project/speculators
  `src/speculators/config.py`, `src/speculators/models/eagle3/config.py`; vLLM
  `vllm/transformers_utils/configs/speculators/{base,algos}.py`): config.json with
  `speculators_model_type: eagle3`, `speculators_config` (algorithm, greedy proposal with
  `speculative_tokens`, verifier), `transformer_layer_config`, `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (HF indices: vLLM captures the input
  of layer id) and the head's normalisation flags always written out: `norm_before_residual`
  (vLLM's updater defaults a missing value to true, while the default head keeps the residual
  before `hidden_norm`), `norm_before_fc`, and `fc_norm: false` / `norm_output: false` (variants
  eyas does not train). Weights as vLLM's `Eagle3LlamaForCausalLM.load_weights` reads them
  (`vllm/model_executor/models/llama_eagle3.py`): `fc.weight`, `input_norm.weight` [3H] (only with
  `norm_before_fc`; vLLM drops the name otherwise), `layers.0.*`, `norm.weight`, `lm_head.weight`,
  `d2t`, `t2d` (skipped); names without `model.`, which its loader prepends; no `embed_tokens`, so
  vLLM shares the target's (`v1/spec_decode/eagle.py`: "EAGLE model without its own embed_tokens").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eyas.draft.blocks import Eagle3Layer, rms_norm
from eyas.draft.config import HeadConfig
from eyas.draft.features import FUSED_LAYERS
from eyas.draft.formats import (
    ExportContext,
    FormatSpec,
    KindExport,
    attention_shapes,
    llama_biases,
    llama_fields,
    mlp_shapes,
    speculators_fields,
)
from eyas.draft.head import DraftHead
from eyas.draft.kinds import KindRules, Variant, option
from eyas.draft.layouts import SHARED_LAYER
from eyas.errors import EyasError

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_ARCHITECTURE = "Eagle3Speculator"
# the engines' EAGLE-3 draft model classes, as the bias refusal names them
_ENGINE_MODELS = {"sglang": "SGLang's LlamaForCausalLMEagle3", "vllm": "vLLM's Eagle3LlamaForCausalLM"}


# ----------------------------------------------------------------------------- export


def _layer(fmt: str) -> str:
    return "midlayer." if fmt == "sglang" else "layers.0."


def _shapes(cfg: HeadConfig, bias: bool, fmt: str) -> dict[str, tuple]:
    h, layer = cfg.hidden_size, _layer(fmt)
    shapes: dict[str, tuple] = {}
    if cfg.norm_before_fc:  # vLLM's model.input_norm (norm_before_fc), over the three target layers
        shapes["input_norm.weight"] = (3 * h,)
    shapes["fc.weight"] = (h, 3 * h)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[f"{layer}{norm}.weight"] = (h,)
    shapes.update(attention_shapes(cfg, f"{layer}self_attn.", 2 * h, bias))
    shapes.update(mlp_shapes(cfg, f"{layer}mlp."))
    shapes["norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.draft_vocab_size, h)
    if cfg.reduced_vocab:
        shapes["d2t"] = (cfg.draft_vocab_size,)
        shapes["t2d"] = (cfg.vocab_size,)
    return shapes


def _biases(cfg: HeadConfig, fmt: str) -> bool:
    """Both engines build the 2H-wide attention without biases."""
    if cfg.qkv_bias:
        raise EyasError(f"the draft has q/k/v biases (target family '{cfg.target_model_type}'), but {_ENGINE_MODELS[fmt]} "
                        "builds its 2H-wide attention without biases; it would load the weights and drop the biases. "
                        "eyas builds EAGLE-3 drafts without biases since; train this draft again")
    return llama_biases(cfg, fmt)


def _to_vllm(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _from_vllm(exported: str) -> str:
    return "midlayer." + exported[len("layers.0."):] if exported.startswith("layers.0.") else exported


def _check_aux_layers(cfg: HeadConfig, where: str) -> None:
    """Serving engines capture the residual stream entering a layer: HF indices 1..L-1 only, each once."""
    depth = cfg.target_hidden_layers
    repeated = sorted({i for i in cfg.aux_layers if list(cfg.aux_layers).count(i) > 1})
    if repeated:
        raise EyasError(f"the draft reads HF hidden_states index {repeated[0]} more than once (layers "
                        f"{list(cfg.aux_layers)}); SGLang and vLLM capture each layer once and would pass it "
                        "fewer features than it was trained on; retrain with three distinct dump.layers")
    for i in cfg.aux_layers:
        if not 1 <= i <= depth - 1:
            raise EyasError(f"the draft reads HF hidden_states index {i}, which SGLang/vLLM cannot capture "
                            f"(they take the input of a decoder layer: indices 1..{depth - 1}); retrain with "
                            "dump.layers inside that range")


def _sglang_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    return {"architectures": [SGLANG_ARCHITECTURE], **llama_fields(cfg, 1, ctx.dtype),
            "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers],
                             "use_aux_hidden_state": True},
            "eyas": ctx.provenance}


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    return {
        "architectures": [VLLM_ARCHITECTURE],
        **speculators_fields("eagle3", ctx),
        "transformer_layer_config": llama_fields(cfg, 1, ctx.dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        # all four written: an absent norm_before_residual is true to vLLM (module docstring)
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norm_before_fc": bool(cfg.norm_before_fc),
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "torch_dtype": ctx.dtype,
        "eyas": ctx.provenance,
    }


def _read_sglang_config(config: dict) -> dict:
    """The layer, fused layers (HF indices) and draft vocabulary of SGLang's config.json (its model has no variants)."""
    return {"layer": config, "num_layers": 1, "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
            "aux_layers": [i + 1 for i in config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", [])]}


def _read_vllm_config(config: dict) -> dict:
    """The layer, fused layers (HF indices), draft vocabulary and variants of vLLM's speculators config.json."""
    # read as vLLM reads them (transformers_utils/configs/speculators/algos.py): an absent
    # norm_before_residual is true there; the two variants eyas has no head for are refused
    for name in ("fc_norm", "norm_output"):
        if config.get(name):
            raise EyasError(f"the export sets {name}: true, an EAGLE-3 variant eyas heads do not have")
    return {"layer": dict(config["transformer_layer_config"]), "num_layers": 1,
            "aux_layers": list(config["eagle_aux_hidden_state_layer_ids"]),
            "draft_vocab_size": int(config["draft_vocab_size"]),
            "norm_before_fc": bool(config.get("norm_before_fc", False)),
            "norm_before_residual": bool(config.get("norm_before_residual", True))}


EXPORT = KindExport(
    formats={
        "sglang": FormatSpec(SGLANG_ARCHITECTURE, "EAGLE3", lambda cfg, bias: _shapes(cfg, bias, "sglang"),
                             _sglang_config, biases=_biases, read_config=_read_sglang_config),
        "vllm": FormatSpec(VLLM_ARCHITECTURE, "eagle3", lambda cfg, bias: _shapes(cfg, bias, "vllm"), _vllm_config,
                           biases=_biases, to_engine=_to_vllm, to_eyas=_from_vllm, read_config=_read_vllm_config,
                           engine_model="Eagle3LlamaForCausalLM"),
    },
    # the engines share the target's embedding; the lm_head is the draft's own (reduced vocabulary)
    from_target=frozenset({"embed_tokens.weight"}),
    check=_check_aux_layers,
)

# ----------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class Eagle3Options:
    """eagle3's own recipe keys: the normalisation variants vLLM serves (module docstring)."""

    eagle3_norm_before_fc: bool = option(
        "eagle3: an RMSNorm over the three fused target layers before fc (vLLM's norm_before_fc; vLLM serves it, "
        "SGLang does not: export with --to vllm).", False)
    eagle3_norm_before_residual: bool = option(
        "eagle3: the layer's residual is hidden_norm(feature), not the feature (vLLM's norm_before_residual; vLLM "
        "serves it, SGLang does not: export with --to vllm).", False)


# vLLM's EAGLE-3 model builds both variants under speculators config flags of these names; SGLang's
# LlamaForCausalLMEagle3 builds neither
RULES = KindRules(title="EAGLE-3", trains_lm_head=True, attention_bias_from_target=False, options=Eagle3Options,
                  variants=(Variant("norm_before_fc", "eagle3_norm_before_fc", ("vllm",)),
                            Variant("norm_before_residual", "eagle3_norm_before_residual", ("vllm",))))


class Eagle3Head(DraftHead):
    kind = "eagle3"
    layout = SHARED_LAYER  # one layer unrolled over the draft steps
    rules = RULES
    feature_spec = FUSED_LAYERS
    supports_draft_vocab = True
    export = EXPORT

    def _build(self, cfg: HeadConfig) -> None:
        if cfg.norm_before_fc:  # starts at 1 (no random init), so the default head's init stream is unchanged
            self.input_norm = LlamaRMSNorm(3 * cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the three fused target layers [.., 3H] -> [.., H] (after `input_norm` with norm_before_fc)."""
        features = features.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        return self.fc(features)

    def step(self, k, input_ids, feature, position_ids, attention_mask=None, past_key_values=None):
        embeds, feature, cos, sin = self.step_inputs(input_ids, feature, position_ids)
        hidden = self.midlayer(embeds, feature, cos, sin, attention_mask, past_key_values, 0)
        return hidden, self.lm_head(self.norm(hidden))

    def decoder_layers(self) -> list[nn.Module]:
        return [self.midlayer]

    @property
    def projection(self) -> nn.Linear:
        return self.fc  # over the fused layers, once per unroll

    def final_norms(self) -> list[nn.Module]:
        return [self.norm]
