"""The layers every head kind is built from: attention, norms, MLP and three decoder layers.

Sizes come from the target's own config (`HeadConfig`), and norms, rotary embedding and MLP
are transformers' own Llama blocks. The attention is written here because EAGLE-3's layer
attends over a 2 x hidden input (concat(embedding, feature)) and the training-time test
needs a mask no HF layer takes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eyas.draft.config import HeadConfig
from eyas.draft.ttt_attention import compute_dtype, ttt_attention


def layer_config(cfg: HeadConfig) -> LlamaConfig:
    """A LlamaConfig carrying the head's shapes, for transformers' norm/rotary/MLP blocks."""
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters=dict(cfg.rope_parameters),
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=cfg.o_bias, mlp_bias=False,
    )


def rms_norm(cfg: HeadConfig) -> nn.Module:
    return LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


def mlp(cfg: HeadConfig) -> nn.Module:
    return LlamaMLP(layer_config(cfg))


class Fp32Rotary(LlamaRotaryEmbedding):
    """Llama's rotary embedding with its frequencies kept in fp32 when the module is cast.

    DeepSpeed's bf16 and fp16 cast the whole module, buffers included (`module.bfloat16()`); bf16 keeps 8
    bits of mantissa, so the angles at position p drift from the fp32 ones the engines serve with by up to
    p * 2^-9 radians (about 1 radian by position 500). The cast is undone for the two frequency buffers.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self._fp32_inv_freq = self.inv_freq.detach().clone()  # a plain attribute: no cast reaches it

    def _apply(self, fn, recurse=True):  # every .to/.bfloat16/.half/.cuda goes through here
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._fp32_inv_freq.to(self.inv_freq.device)
            self.original_inv_freq = self.inv_freq.clone()
        return self


def rotary_embedding(cfg: HeadConfig) -> nn.Module:
    return Fp32Rotary(layer_config(cfg))


class TTTCache:
    """Keys/values of a training-time-test unroll, one block per step and layer.

    Block 0 holds the context (step 0 at every position); block j >= 1 holds step j's
    entries. The mask it implies (see `eyas.draft.ttt_attention`): the query of step k
    at slot t attends to block-0 keys at slots s <= t and to block-j keys (1 <= j <= k) at
    slot t only; exactly what a draft sees at inference after context 0..t.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> list:
        self.blocks.setdefault(layer_idx, []).append((key, value))
        return self.blocks[layer_idx]


class DraftAttention(nn.Module):
    """Multi-head attention with GQA and RoPE over an input of `in_features` (H or 2H)."""

    def __init__(self, cfg: HeadConfig, in_features: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: Any,
                past_key_values: Any, layer_idx: int) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(past_key_values, TTTCache):
            # Kept in the dtype attention runs in (autocast's: RoPE hands fp32 keys out under it), so later
            # steps read them as they are instead of casting, and saving, every earlier step's copy again.
            dtype = compute_dtype(q)
            out = self._ttt_attention(q, past_key_values.append(layer_idx, k.to(dtype), v.to(dtype)))
        else:
            out = self._cached_attention(q, k, v, attention_mask, past_key_values, layer_idx)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim))

    def _cached_attention(self, q, k, v, attention_mask, cache, layer_idx):
        """Plain attention (optionally through a transformers Cache); None mask = causal."""
        past = 0
        if cache is not None:
            past = cache.get_seq_length(layer_idx)
            k, v = cache.update(k, v, layer_idx)
        seq = q.shape[2]
        if attention_mask is None and past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, scale=self.scaling, enable_gqa=True)
        if attention_mask is None:  # new tokens continue the cached ones: causal with an offset
            rows = torch.arange(seq, device=q.device)[:, None] + past
            attention_mask = torch.arange(past + seq, device=q.device)[None, :] <= rows
        elif attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True)

    def _ttt_attention(self, q, blocks):
        """Training-time-test attention: context block causal, earlier steps' blocks on the diagonal only.

        Memory linear in the sequence (`eyas.draft.ttt_attention`: a fused causal kernel for the
        context merged with the diagonal scores through their log-sum-exp); no (k+1)T-wide mask.
        """
        return ttt_attention(q, blocks, self.scaling)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over concat(norm(embedding), norm(feature)), 2H wide.

    The residual stream starts from the raw feature, as in EAGLE-3; with `cfg.norm_before_residual`
    (the variant vLLM serves under that flag) it starts from hidden_norm(feature), so the
    stream, and the hidden handed to the next draft step, are built on the normalised feature.
    """

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg)
        self.hidden_norm = rms_norm(cfg)
        self.self_attn = DraftAttention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = mlp(cfg)
        self.norm_before_residual = bool(cfg.norm_before_residual)

    def forward(self, embeds, feature, cos, sin, attention_mask, cache, layer_idx):
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, cos, sin, attention_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; EAGLE-1's layer 0 has no input norm (its fc output goes straight in)."""

    def __init__(self, cfg: HeadConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg) if input_norm else nn.Identity()
        self.self_attn = DraftAttention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = mlp(cfg)

    def forward(self, x, cos, sin, attention_mask, cache, layer_idx):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPLayer(nn.Module):
    """One multi-token-prediction step (DeepSeek-V3 layout): eh_proj(concat(enorm(e), hnorm(h))) -> layer -> norm."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.enorm = rms_norm(cfg)
        self.hnorm = rms_norm(cfg)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = rms_norm(cfg)
        self.self_attn = DraftAttention(cfg, hidden)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = mlp(cfg)
        self.norm = rms_norm(cfg)

    def forward(self, embeds, feature, cos, sin, attention_mask, cache, layer_idx):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))
