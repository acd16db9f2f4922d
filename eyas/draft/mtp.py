"""`mtp`: one independent layer per draft step (DeepSeek-V3's MTP layout), embedding and lm_head the target's.

Weight names: `embed_tokens.weight` and `lm_head.weight` (both frozen, the target's; the lm_head
rows of the reduced draft vocabulary when one is used), and per step k
`layers.{k}.{enorm,hnorm}.weight`, `layers.{k}.eh_proj.weight` [H, 2H],
`layers.{k}.{input_layernorm,post_attention_layernorm}.weight`, `layers.{k}.self_attn.*`,
`layers.{k}.mlp.*`, `layers.{k}.norm.weight`.

Layer k has its own KV cache (KV layer index k) and attends causally to its own step's keys.
Step k+1 reads step k's output hidden (`mtp_feed: chain`) or the target's feature again
(`mtp_feed: target`); its token is the data's (teacher forcing) in training.

Export (`EXPORT`, driven by `eyas export`; the public source each format was checked against,
facts read there, no code copied). Both formats refuse a reduced draft vocabulary: the engines run
MTP layers through the target's full lm_head.

- `--to sglang`: the names SGLang's multi-layer EAGLE worker reads
  (`python/sglang/srt/speculative/multi_layer_eagle_worker.py`): it builds one model runner per
  step with `draft_model_idx=k`, and `DefaultModelLoader._filter_mtp_weights`
  (`python/sglang/srt/model_loader/loader.py`) keeps only `model.mtp.layers.{k}.*` for runner k.
  Per step: `enorm`, `hnorm`, `eh_proj`, `final_layernorm` and the decoder layer
  (`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`), as the per-step MTP
  model of `models/mimo_v2_mtp.py` maps them; `num_nextn_predict_layers` = steps; embedding and
  lm_head come from the target (`set_embed_and_head`). SGLang has per-step MTP model classes
  only for some families (`SGLANG_MTP_CLASSES`); for others the file has the worker's layout but
  no class to load it.
- `--to vllm` (issue 14): through eyas's plugin `eyas.serving.vllm_mtp` (entry point
  `vllm.general_plugins: eyas_mtp`, docs/serving-mtp.md). vLLM 0.32's V1 runner passes a step
  index to the draft only through `Step3p5MTPProposer`, chosen when the draft config's
  model_type is `step3p5_mtp` (config/speculative.py `use_step3p5_mtp`); the plugin registers that
  config type and the architecture `EyasLlamaMTP`. Tensors: the SGLang names above; embedding and
  lm_head are the target's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from eyas.draft.blocks import MTPLayer
from eyas.draft.config import HeadConfig
from eyas.draft.formats import ExportContext, FormatSpec, KindExport, attention_shapes, llama_config, mlp_shapes, read_llama
from eyas.draft.head import DraftHead
from eyas.draft.kinds import KindRules, option
from eyas.draft.layouts import LAYER_PER_STEP
from eyas.errors import EyasError

MTP_FEEDS = ("target", "chain")

# SGLang: per-step layers under model.mtp.layers.{k}, named for SGLang's multi-layer worker (SGLang has
# no class of that name for Llama targets yet); vLLM: eyas's plugin (eyas.serving.vllm_mtp)
SGLANG_ARCHITECTURE = "EyasMultiLayerMTP"
VLLM_ARCHITECTURE = "EyasLlamaMTP"
# Per-step MTP model classes SGLang has, by target family.
SGLANG_MTP_CLASSES = {"mimo_v2": "MiMoV2MTP", "mimo_v2_flash": "MiMoV2MTP"}
_ENGINE_PREFIX = "model.mtp.layers."

# ----------------------------------------------------------------------------- export


def _shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
    h = cfg.hidden_size
    shapes: dict[str, tuple] = {}
    for k in range(cfg.num_layers):
        p = f"{_ENGINE_PREFIX}{k}."
        for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
            shapes[f"{p}{norm}.weight"] = (h,)
        shapes[f"{p}eh_proj.weight"] = (h, 2 * h)
        shapes.update(attention_shapes(cfg, f"{p}self_attn.", h, bias))
        shapes.update(mlp_shapes(cfg, f"{p}mlp."))
    return shapes


def _to_engine(name: str) -> str:
    """layers.{k}.X -> model.mtp.layers.{k}.X (the step's final norm is `final_layernorm` there)."""
    if not name.startswith("layers."):
        return name
    step, _, rest = name[len("layers."):].partition(".")
    rest = "final_layernorm.weight" if rest == "norm.weight" else rest
    return f"{_ENGINE_PREFIX}{step}.{rest}"


def _to_eyas(exported: str) -> str:
    if not exported.startswith(_ENGINE_PREFIX):
        return exported
    return ("layers." + exported[len(_ENGINE_PREFIX):]).replace(".final_layernorm.", ".norm.")


def _check_full_vocab(cfg: HeadConfig, where: str) -> None:
    if cfg.reduced_vocab:
        raise EyasError(f"'{where}' is an mtp draft over a reduced vocabulary of {cfg.draft_vocab_size} tokens, "
                        "but serving engines run MTP layers through the target's full lm_head; retrain it with "
                        "draft.use_draft_vocab=false to export it")


def _check_vllm_steps(cfg: HeadConfig, steps: int) -> None:
    """What the vLLM mtp plugin cannot serve, refused before anything is written."""
    if not cfg.tie_word_embeddings:
        raise EyasError(f"the target ('{cfg.target_model_type}') has an lm_head separate from its embedding, and "
                        "vLLM's Step3p5 MTP proposer does not share the target's lm_head with the draft, so the eyas "
                        "plugin (which uses the shared embedding as the lm_head) cannot serve it yet; "
                        "use --to sglang for it")
    if steps > cfg.num_layers:
        raise EyasError(f"--num-speculative-tokens {steps} is more than the mtp draft's {cfg.num_layers} layers "
                        f"(one per draft step); use {cfg.num_layers} or fewer")


def _sglang_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    architecture = SGLANG_MTP_CLASSES.get(cfg.target_model_type, SGLANG_ARCHITECTURE)
    config = llama_config(architecture, cfg, ctx, num_layers=cfg.num_layers)
    config["num_nextn_predict_layers"] = cfg.num_layers
    config["eyas"] = ctx.provenance
    return config


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    """config.json for `EyasLlamaMTP`: Llama shapes, model_type step3p5_mtp, the eyas block the plugin reads."""
    layers = int(cfg.num_layers)
    config = llama_config(VLLM_ARCHITECTURE, cfg, ctx, num_layers=cfg.target_hidden_layers)
    config.update(model_type="step3p5_mtp", num_nextn_predict_layers=layers, n_predict=layers, tie_word_embeddings=True)
    config["eyas"] = dict(ctx.provenance, rope_parameters=dict(cfg.rope_parameters), lm_head="tied",
                          target_hidden_layers=cfg.target_hidden_layers, speculative_tokens=ctx.speculative_tokens,
                          verifier=ctx.target.get("path"), plugin="eyas.serving.vllm_mtp")
    return config


def _read_config(config: dict) -> dict:
    """A plain Llama layout with one layer per draft step."""
    return dict(read_llama(config), num_layers=int(config.get("num_nextn_predict_layers", 1)))


EXPORT = KindExport(
    formats={
        "sglang": FormatSpec(SGLANG_ARCHITECTURE, "EAGLE", _shapes, _sglang_config, to_engine=_to_engine,
                             to_eyas=_to_eyas, serve_flags=" --enable-multi-layer-eagle",
                             aliases=tuple(sorted(set(SGLANG_MTP_CLASSES.values()))), read_config=_read_config),
        "vllm": FormatSpec(VLLM_ARCHITECTURE, "mtp", _shapes, _vllm_config, to_engine=_to_engine, to_eyas=_to_eyas,
                           check_steps=_check_vllm_steps, read_config=_read_config, plugin="eyas.serving.vllm_mtp"),
    },
    from_target=frozenset({"embed_tokens.weight", "lm_head.weight"}),
    check=_check_full_vocab,
    default_steps=lambda cfg: cfg.num_layers,  # one draft step per layer
)

# ----------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class MTPOptions:
    """mtp's own recipe key."""

    mtp_feed: str = option("mtp: chain (step k reads step k-1's hidden) or target (every step reads the target's).",
                           "chain", choices=("chain", "target"))


class MTPHead(DraftHead):
    kind = "mtp"
    layout = LAYER_PER_STEP  # layer k drafts step k
    rules = KindRules(title="MTP", options=MTPOptions)
    default_token_feed = "data"
    supports_draft_vocab = True
    export = EXPORT

    @classmethod
    def layers_for(cls, draft_cfg: Any) -> int:
        return int(draft_cfg.num_steps)

    @classmethod
    def head_config(cls, draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity) -> HeadConfig:
        cfg = super().head_config(draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity)
        return dataclasses.replace(cfg, mtp_feed=cls.recipe_options(draft_cfg).mtp_feed)

    def _build(self, cfg: HeadConfig) -> None:
        self.layers = nn.ModuleList([MTPLayer(cfg) for _ in range(cfg.num_layers)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def step(self, k, input_ids, feature, position_ids, attention_mask=None, past_key_values=None):
        if not 0 <= k < self.num_layers:
            raise IndexError(f"mtp head has {self.num_layers} layers; step {k} does not exist")
        embeds, feature, cos, sin = self.step_inputs(input_ids, feature, position_ids)
        layer = self.layers[k]
        hidden = layer(embeds, feature, cos, sin, attention_mask, past_key_values, k)
        return hidden, self.lm_head(layer.norm(hidden))

    def next_feature(self, hidden, target_feature):
        """`mtp_feed: chain` reads the previous layer's hidden, `target` the target's feature at every step."""
        return target_feature if self.config.mtp_feed == "target" else hidden

    def max_depth(self) -> int:
        return self.num_layers

    def final_norms(self) -> list[nn.Module]:
        return [layer.norm for layer in self.layers]
