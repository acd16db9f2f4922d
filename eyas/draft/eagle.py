"""`eagle` (EAGLE-1): fc(concat(embedding, feature)) into one Llama layer, shared by every step.

Weight names (SGLang's LlamaForCausalLMEagle): `embed_tokens.weight` (frozen), `fc.weight`
[H, 2H] + `fc.bias`, `layers.0.self_attn.*`, `layers.0.post_attention_layernorm.weight`,
`layers.0.mlp.*` (no input norm, as EAGLE-1), `lm_head.weight` (frozen, the target's, full
vocabulary: serving engines load EAGLE-1 drafts with it). It regresses the target's next
feature besides the token loss and trains one step.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.draft.blocks import DecoderLayer
from eyas.draft.config import HeadConfig
from eyas.draft.head import DraftHead


class EagleHead(DraftHead):
    kind = "eagle"
    feature_regression = True
    export_architectures = {"sglang": "LlamaForCausalLMEagle", "vllm": "EagleLlamaForCausalLM"}
    vllm_method = "eagle"

    def _build(self, cfg: HeadConfig) -> None:
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg, input_norm=False)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def step(self, k, input_ids, feature, position_ids, attention_mask=None, past_key_values=None):
        embeds, feature, cos, sin = self.step_inputs(input_ids, feature, position_ids)
        x = self.fc(torch.cat([embeds, feature], dim=-1))
        hidden = self.layers[0](x, cos, sin, attention_mask, past_key_values, 0)
        return hidden, self.lm_head(hidden)  # EAGLE-1 regresses the post-norm feature: no final norm
