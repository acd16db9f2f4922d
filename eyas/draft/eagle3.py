"""`eagle3` (EAGLE-3): one layer over concat(embedding, fc(three fused target layers)), shared by every step.

Weight names (SGLang's LlamaForCausalLMEagle3): `embed_tokens.weight` (frozen, the target's),
`fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [V_draft, H], buffers `d2t` [V_draft] and `t2d` [V] (only with
a reduced draft vocabulary). Attention biases exist when the target has them (Qwen2: q/k/v).

Normalisation variants (recipe keys `draft.eagle3_norm_before_fc` / `draft.eagle3_norm_before_residual`,
HeadConfig `norm_before_fc` / `norm_before_residual`), as vLLM's EAGLE-3 draft model builds them
under the speculators config flags of the same names:
- norm_before_fc: `input_norm.weight` [3H], an RMSNorm over the concatenated three target layers
  before `fc` (the three layers' scales differ a lot; one norm puts them on a common one);
- norm_before_residual: the layer's residual is hidden_norm(feature) (see `Eagle3Layer`).
SGLang's LlamaForCausalLMEagle3 has neither, so `eyas export` sends such a head to vLLM only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eyas.draft.blocks import Eagle3Layer, rms_norm
from eyas.draft.config import HeadConfig
from eyas.draft.head import DraftHead


class Eagle3Head(DraftHead):
    kind = "eagle3"
    feature = "aux_hidden"
    supports_draft_vocab = True
    export_architectures = {"sglang": "LlamaForCausalLMEagle3", "vllm": "Eagle3Speculator"}
    vllm_method = "eagle3"

    @classmethod
    def trains_lm_head(cls, draft_cfg: Any) -> bool:
        return bool(getattr(draft_cfg, "train_lm_head", True))

    @classmethod
    def head_config(cls, draft_cfg: Any, target_config: Any, aux_layers: list[int],
                    draft_vocab_size: int | None, target_identity: str) -> HeadConfig:
        """The shared config plus the normalisation variants of the recipe's draft section (off when absent)."""
        cfg = super().head_config(draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity)
        return dataclasses.replace(cfg, norm_before_fc=bool(getattr(draft_cfg, "eagle3_norm_before_fc", False)),
                                   norm_before_residual=bool(getattr(draft_cfg, "eagle3_norm_before_residual", False)))

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

    def _final_norms(self) -> list[nn.Module]:
        return [self.norm]
