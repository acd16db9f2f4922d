"""`eagle` (EAGLE-1): fc(concat(embedding, feature)) into one Llama layer, shared by every step.

Weight names (SGLang's LlamaForCausalLMEagle): `embed_tokens.weight` (frozen), `fc.weight`
[H, 2H] + `fc.bias`, `layers.0.self_attn.*`, `layers.0.post_attention_layernorm.weight`,
`layers.0.mlp.*` (no input norm, as EAGLE-1), `lm_head.weight` (frozen, the target's, full
vocabulary: serving engines load EAGLE-1 drafts with it). It regresses the target's next
feature besides the token loss and trains one step.

Export (`EXPORT`, driven by `eyas export`; the public source each format was checked against,
facts read there, no code copied):

- `--to sglang`: architecture `LlamaForCausalLMEagle` (`python/sglang/srt/models/llama_eagle.py`):
  `fc.weight` [H, 2H] + `fc.bias`, `layers.0.*` without `input_layernorm` (deleted for layer 0),
  no final norm; embedding and lm_head are the target's (`set_embed_and_head`).
- `--to vllm`: vLLM's `EagleLlamaForCausalLM` (`vllm/model_executor/models/llama_eagle.py`), served
  with `"method": "eagle"`. A plain Llama config.json (`EAGLEConfig` in
  `vllm/transformers_utils/configs/eagle.py` keeps an architecture that starts with `Eagle`);
  weights `fc.weight` [H, 2H], `layers.0.*` without `input_layernorm` (replaced by an identity
  for layer 0), no final norm, embedding and lm_head shared from the target. vLLM builds `fc`
  without a bias, so the export folds the head's `fc.bias` b into the layer, exactly: the layer
  reads x = W u + b straight (no input norm) and adds it to the residual, so q/k/v get the
  biases W_q b, W_k b, W_v b and o_proj gets b (`attention_bias: true`; vLLM's Llama layer puts
  biases on q/k/v and o_proj together). The logits equal the head's up to float rounding.
  `EagleLlamaForCausalLM.load_weights` returns nothing, so vLLM itself would not report a
  missing tensor: `eyas.eval.engine_vllm` checks the loaded names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.draft.blocks import DecoderLayer
from eyas.draft.config import HeadConfig
from eyas.draft.formats import ExportContext, FormatSpec, KindExport, attention_shapes, llama_config, mlp_shapes
from eyas.draft.head import DraftHead
from eyas.draft.kinds import KindRules
from eyas.draft.layouts import SHARED_LAYER
from eyas.errors import EyasError

# ----------------------------------------------------------------------------- export


def _shapes(cfg: HeadConfig, bias: bool, folded: bool) -> dict[str, tuple]:
    h = cfg.hidden_size
    shapes: dict[str, tuple] = {"fc.weight": (h, 2 * h)}
    if not folded:
        shapes["fc.bias"] = (h,)
    shapes["layers.0.post_attention_layernorm.weight"] = (h,)
    shapes.update(attention_shapes(cfg, "layers.0.self_attn.", h, bias or folded))
    shapes.update(mlp_shapes(cfg, "layers.0.mlp."))
    return shapes


def fold_fc_bias(state: dict[str, torch.Tensor], cfg: HeadConfig) -> dict[str, torch.Tensor]:
    """For vLLM: move `fc.bias` b into the layer (q/k/v biases W b, o_proj bias b).

    Exact in real arithmetic: layer 0 reads x = W u + b with no input norm, so
    q = W_q x = W_q W u + W_q b (likewise k, v; RoPE comes after the bias), and the residual
    x + o_proj(attn) = W u + (o_proj(attn) + b). Computed in float64, returned in the input dtype.
    """
    if "fc.bias" not in state:
        raise EyasError("the eagle checkpoint lacks 'fc.bias', which the EAGLE-1 head always has; "
                        "re-save it with eyas train")
    out = dict(state)
    b = out.pop("fc.bias").double()
    prefix = "layers.0.self_attn."
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = out[f"{prefix}{proj}.weight"]
        bias = weight.double() @ b
        if f"{prefix}{proj}.bias" in out:
            bias = bias + out[f"{prefix}{proj}.bias"].double()
        out[f"{prefix}{proj}.bias"] = bias.to(weight.dtype)
    o_bias = b + (out[f"{prefix}o_proj.bias"].double() if f"{prefix}o_proj.bias" in out else 0.0)
    out[f"{prefix}o_proj.bias"] = o_bias.to(out[f"{prefix}o_proj.weight"].dtype)
    return out


def _zero_fc_bias(state: dict[str, torch.Tensor], cfg: HeadConfig) -> dict[str, torch.Tensor]:
    """Read back from vLLM: the bias lives in the layer (fold_fc_bias), so the head's own is zero."""
    return dict(state, **{"fc.bias": torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)})


def _sglang_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    return dict(llama_config(SGLANG_ARCHITECTURE, cfg, ctx), eyas=ctx.provenance)


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    config = llama_config(VLLM_ARCHITECTURE, cfg, ctx)
    config["attention_bias"] = True  # carries the folded fc.bias (fold_fc_bias)
    config["eyas"] = dict(ctx.provenance, fc_bias_folded=True, speculative_tokens=ctx.speculative_tokens,
                          verifier=ctx.target.get("path"))
    return config


SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle"
VLLM_ARCHITECTURE = "EagleLlamaForCausalLM"
EXPORT = KindExport(
    formats={
        "sglang": FormatSpec(SGLANG_ARCHITECTURE, "EAGLE", lambda cfg, bias: _shapes(cfg, bias, folded=False),
                             _sglang_config),
        "vllm": FormatSpec(VLLM_ARCHITECTURE, "eagle", lambda cfg, bias: _shapes(cfg, bias, folded=True), _vllm_config,
                           prepare=fold_fc_bias, restore=_zero_fc_bias, engine_model="EagleLlamaForCausalLM"),
    },
    from_target=frozenset({"embed_tokens.weight", "lm_head.weight"}),
)

# ----------------------------------------------------------------------------- the head


class EagleHead(DraftHead):
    kind = "eagle"
    layout = SHARED_LAYER  # one layer unrolled over the draft steps
    rules = KindRules(title="EAGLE-1")
    export = EXPORT

    @classmethod
    def unroll_steps(cls, ttt_steps: int) -> int:
        return 1  # EAGLE-1 trains one step, plus its feature regression

    def feature_loss_sum(self, hidden, last_hidden, loss_mask):
        """Slot t's output hidden against the target's f_{t+1} (smooth L1, mean over H), summed over the mask."""
        seq = hidden.shape[1]
        if seq < 3:
            return hidden.sum() * 0.0
        per_pos = F.smooth_l1_loss(hidden[:, :seq - 2].float(), last_hidden[:, 1:seq - 1].float(),
                                   reduction="none").mean(-1)
        return (per_pos * loss_mask[:, 2:]).sum()

    def _build(self, cfg: HeadConfig) -> None:
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg, input_norm=False)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def step(self, k, input_ids, feature, position_ids, attention_mask=None, past_key_values=None):
        embeds, feature, cos, sin = self.step_inputs(input_ids, feature, position_ids)
        x = self.fc(torch.cat([embeds, feature], dim=-1))
        hidden = self.layers[0](x, cos, sin, attention_mask, past_key_values, 0)
        return hidden, self.lm_head(hidden)  # EAGLE-1 regresses the post-norm feature: no final norm

    @property
    def projection(self) -> nn.Linear:
        return self.fc  # over [embedding; feature], in the one step EAGLE-1 trains
