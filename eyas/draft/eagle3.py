"""`eagle3` (EAGLE-3): one layer over concat(embedding, fc(three fused target layers)), shared by every step.

Weight names (SGLang's LlamaForCausalLMEagle3): `embed_tokens.weight` (frozen, the target's),
`fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [V_draft, H], buffers `d2t` [V_draft] and `t2d` [V] (only with
a reduced draft vocabulary). Attention biases exist when the target has them (Qwen2: q/k/v).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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

    def _build(self, cfg: HeadConfig) -> None:
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the three fused target layers [.., 3H] -> [.., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def step(self, k, input_ids, feature, position_ids, attention_mask=None, past_key_values=None):
        embeds, feature, cos, sin = self.step_inputs(input_ids, feature, position_ids)
        hidden = self.midlayer(embeds, feature, cos, sin, attention_mask, past_key_values, 0)
        return hidden, self.lm_head(self.norm(hidden))

    def _final_norms(self) -> list[nn.Module]:
        return [self.norm]
