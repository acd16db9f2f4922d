"""`mtp`: one independent layer per draft step (DeepSeek-V3's MTP layout), embedding and lm_head the target's.

Weight names: `embed_tokens.weight` and `lm_head.weight` (both frozen, the target's; the lm_head
rows of the reduced draft vocabulary when one is used), and per step k
`layers.{k}.{enorm,hnorm}.weight`, `layers.{k}.eh_proj.weight` [H, 2H],
`layers.{k}.{input_layernorm,post_attention_layernorm}.weight`, `layers.{k}.self_attn.*`,
`layers.{k}.mlp.*`, `layers.{k}.norm.weight`.

Layer k has its own KV cache (KV layer index k) and attends causally to its own step's keys.
Step k+1 reads step k's output hidden (`mtp_feed: chain`) or the target's feature again
(`mtp_feed: target`); its token is the data's (teacher forcing) in training.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from eyas.draft.blocks import MTPLayer
from eyas.draft.config import HeadConfig
from eyas.draft.head import DraftHead

MTP_FEEDS = ("target", "chain")


class MTPHead(DraftHead):
    kind = "mtp"
    shares_layer = False
    default_token_feed = "data"
    supports_draft_vocab = True
    # SGLang: per-step layers under model.mtp.layers.{k}, named for SGLang's multi-layer worker
    # (SGLang has no class of that name for Llama targets yet); vLLM: eyas's plugin (eyas.serving.vllm_mtp)
    export_architectures = {"sglang": "EyasMultiLayerMTP", "vllm": "EyasLlamaMTP"}
    vllm_method = "mtp"

    @classmethod
    def layers_for(cls, draft_cfg: Any) -> int:
        return int(draft_cfg.num_steps)

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

    def chains_hidden(self) -> bool:
        return self.config.mtp_feed != "target"

    def max_depth(self) -> int:
        return self.num_layers

    def _final_norms(self) -> list[nn.Module]:
        return [layer.norm for layer in self.layers]
