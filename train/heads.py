"""Draft heads: `eagle` (EAGLE-1), `eagle3` (EAGLE-3) and `mtp` (one layer per draft step).

One definition serves every Llama-like target (Llama, Qwen2/3, Mistral, SmolLM2): the
layers are sized from the target's own config (hidden size, heads, kv heads, head_dim,
RoPE incl. `rope_parameters` scaling, `rms_norm_eps`, attention biases) and built from
transformers' own blocks (`LlamaRMSNorm`, `LlamaRotaryEmbedding`, `LlamaMLP`). The
attention is written here because EAGLE-3's layer attends over a 2 x hidden input
(concat(embedding, feature)) and the training-time test needs a mask no HF layer takes.

Semantics (EAGLE): at position t the head reads the feature f_t (the target's hidden state
at t for step 0) and the embedding of token x_{t+1}, and predicts x_{t+2}. Step k > 0 reads
the previous step's output hidden as its feature and the embedding of the token it drafted.

Weight names (the state_dict keys; `eyas export` maps them to the serving engines):

- eagle3: `embed_tokens.weight` (frozen, the target's), `fc.weight` [H, 3H],
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight` [V_draft, H], buffers `d2t` [V_draft] and `t2d` [V]
  (only with a reduced draft vocabulary). These are SGLang's LlamaForCausalLMEagle3 names.
- eagle: `embed_tokens.weight` (frozen), `fc.weight` [H, 2H] + `fc.bias`, `layers.0.self_attn.*`,
  `layers.0.post_attention_layernorm.weight`, `layers.0.mlp.*` (no input norm, as EAGLE-1),
  `lm_head.weight` (frozen, the target's).
- mtp: `embed_tokens.weight` and `lm_head.weight` (both frozen, the target's), and per step k
  `layers.{k}.{enorm,hnorm}.weight`, `layers.{k}.eh_proj.weight` [H, 2H],
  `layers.{k}.{input_layernorm,post_attention_layernorm}.weight`, `layers.{k}.self_attn.*`,
  `layers.{k}.mlp.*`, `layers.{k}.norm.weight` (DeepSeek-V3 MTP layout).
Attention biases (`*_proj.bias`) exist when the target has them (Qwen2: q/k/v).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.errors import EyasError

KINDS = ("eagle", "eagle3", "mtp")
# kinds that may predict over the reduced draft vocabulary (EAGLE-1 keeps the target's full head,
# which is what serving engines load it with)
VOCAB_KINDS = ("eagle3", "mtp")
HEAD_FORMAT_VERSION = 1


def uses_draft_vocab(draft_cfg: Any) -> bool:
    """Whether a head of this recipe predicts over the reduced draft vocabulary (d2t/t2d)."""
    return draft_cfg.kind in VOCAB_KINDS and bool(draft_cfg.use_draft_vocab)


# Families whose q/k/v projections always carry a bias although their config has no
# `attention_bias` field (transformers hard-codes it).
_QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe", "qwen2_vl")


def _rope_parameters(target_config: Any) -> dict:
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


def head_config(draft_cfg: Any, target_config: Any, aux_layers: list[int] | None = None,
                draft_vocab_size: int | None = None, target_identity: str = "") -> dict:
    """Everything needed to rebuild a head without the target: written as config.json."""
    kind = draft_cfg.kind
    if kind not in KINDS:
        raise EyasError(f"draft.kind '{kind}' is not one of {', '.join(KINDS)}")
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    model_type = str(getattr(text, "model_type", ""))
    attention_bias = bool(getattr(text, "attention_bias", False))
    qkv_bias = attention_bias or model_type in _QKV_BIAS_FAMILIES
    vocab = int(text.vocab_size)
    if not uses_draft_vocab(draft_cfg) or not draft_vocab_size or draft_vocab_size >= vocab:
        draft_vocab_size = vocab
    return {
        "format": "eyas-draft",
        "format_version": HEAD_FORMAT_VERSION,
        "kind": kind,
        "num_layers": int(draft_cfg.num_steps) if kind == "mtp" else 1,
        "num_steps": int(draft_cfg.num_steps),
        "mtp_feed": draft_cfg.mtp_feed,
        "aux_layers": list(aux_layers or []),
        "hidden_size": hidden,
        "intermediate_size": int(draft_cfg.intermediate_size or text.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
        "hidden_act": str(getattr(text, "hidden_act", "silu")),
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
        "qkv_bias": qkv_bias,
        "o_bias": attention_bias,
        "rope_parameters": _rope_parameters(text),
        "max_position_embeddings": int(text.max_position_embeddings),
        "initializer_range": float(getattr(text, "initializer_range", 0.02)),
        "vocab_size": vocab,
        "draft_vocab_size": int(draft_vocab_size),
        "target_model_type": model_type,
        "target_hidden_layers": int(text.num_hidden_layers),
        "tie_word_embeddings": bool(getattr(target_config, "tie_word_embeddings", False)),
        "target_identity": target_identity,
        "train_lm_head": bool(getattr(draft_cfg, "train_lm_head", True)) if kind == "eagle3" else False,
    }


def _layer_config(cfg: dict) -> Any:
    """A LlamaConfig carrying the head's shapes, for transformers' norm/rotary/MLP blocks."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], hidden_act=cfg["hidden_act"],
        rms_norm_eps=cfg["rms_norm_eps"], rope_parameters=dict(cfg["rope_parameters"]),
        max_position_embeddings=cfg["max_position_embeddings"], attention_bias=cfg["o_bias"], mlp_bias=False,
    )


class TTTCache:
    """Keys/values of an EAGLE-3 training-time-test unroll, one block per step and layer.

    Block 0 holds the context (step 0 at every position); block j >= 1 holds step j's
    entries. The mask it implies (see `DraftAttention._ttt_attention`): the query of step k
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

    def __init__(self, cfg: dict, in_features: int) -> None:
        super().__init__()
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=cfg["qkv_bias"])
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=cfg["qkv_bias"])
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=cfg["qkv_bias"])
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg["hidden_size"], bias=cfg["o_bias"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: Any,
                past_key_values: Any, layer_idx: int) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(past_key_values, TTTCache):
            out = self._ttt_attention(q, past_key_values.append(layer_idx, k, v))
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
        """EAGLE-3 training-time-test attention without materialising the (k+1)T-wide mask.

        Scores are [context block, causal over slots s <= t] followed by one score per earlier
        step j (its key at the same slot t, the diagonal); one softmax over both parts.
        """
        bsz, _, seq, dim = q.shape
        groups = self.num_heads // self.num_kv_heads
        qg = q.view(bsz, self.num_kv_heads, groups, seq, dim)
        k0, v0 = blocks[0]
        if len(blocks) == 1:
            return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=self.scaling, enable_gqa=True)
        ctx = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)) * self.scaling  # [B, KV, G, T, T]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        ctx = ctx.masked_fill(causal, float("-inf"))
        diag = torch.stack([(qg * kj.unsqueeze(2)).sum(-1) for kj, _ in blocks[1:]], dim=-1) * self.scaling
        probs = torch.softmax(torch.cat([ctx, diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs[..., :seq], v0.unsqueeze(2))
        for j, (_, vj) in enumerate(blocks[1:]):
            out = out + probs[..., seq + j: seq + j + 1] * vj.unsqueeze(2)
        return out.reshape(bsz, self.num_heads, seq, dim)


def _rms_norm(cfg: dict) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])


def _mlp(cfg: dict) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(_layer_config(cfg))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over concat(norm(embedding), norm(feature)), 2H wide."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.input_layernorm = _rms_norm(cfg)
        self.hidden_norm = _rms_norm(cfg)
        self.self_attn = DraftAttention(cfg, 2 * cfg["hidden_size"])
        self.post_attention_layernorm = _rms_norm(cfg)
        self.mlp = _mlp(cfg)

    def forward(self, embeds, feature, cos, sin, attention_mask, cache, layer_idx):
        residual = feature  # the residual stream is the feature, as in EAGLE-3
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        h = residual + self.self_attn(x, cos, sin, attention_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; EAGLE-1's layer 0 has no input norm (its fc output goes straight in)."""

    def __init__(self, cfg: dict, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = _rms_norm(cfg) if input_norm else nn.Identity()
        self.self_attn = DraftAttention(cfg, cfg["hidden_size"])
        self.post_attention_layernorm = _rms_norm(cfg)
        self.mlp = _mlp(cfg)

    def forward(self, x, cos, sin, attention_mask, cache, layer_idx):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPLayer(nn.Module):
    """One multi-token-prediction step (DeepSeek-V3 layout): eh_proj(concat(enorm(e), hnorm(h))) -> layer -> norm."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.enorm = _rms_norm(cfg)
        self.hnorm = _rms_norm(cfg)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = _rms_norm(cfg)
        self.self_attn = DraftAttention(cfg, hidden)
        self.post_attention_layernorm = _rms_norm(cfg)
        self.mlp = _mlp(cfg)
        self.norm = _rms_norm(cfg)

    def forward(self, embeds, feature, cos, sin, attention_mask, cache, layer_idx):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """A draft head of one kind; see the module docstring for the weight names.

    Frozen parts (the target's embedding, and its lm_head for eagle/mtp) have
    requires_grad=False; `trainable_parameters()` lists the rest.
    """

    def __init__(self, cfg: dict, d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = dict(cfg)
        self.kind = cfg["kind"]
        hidden, vocab, draft_vocab = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
        self.embed_tokens = nn.Embedding(vocab, hidden)
        if self.kind == "eagle3":
            self.fc = nn.Linear(3 * hidden, hidden, bias=False)
            self.midlayer = Eagle3Layer(cfg)
            self.norm = _rms_norm(cfg)
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        elif self.kind == "eagle":
            self.fc = nn.Linear(2 * hidden, hidden, bias=True)
            self.layers = nn.ModuleList([DecoderLayer(cfg, input_norm=False)])
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
        else:
            self.layers = nn.ModuleList([MTPLayer(cfg) for _ in range(cfg["num_layers"])])
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(_layer_config(cfg))
        self._init_weights(cfg["initializer_range"])
        self.embed_tokens.requires_grad_(False)
        if not cfg.get("train_lm_head", self.kind == "eagle3"):
            self.lm_head.requires_grad_(False)
        self.register_buffer("d2t", None)  # None buffers stay out of the state_dict
        self.register_buffer("t2d", None)
        if draft_vocab != vocab:
            self._set_vocab_maps(d2t, vocab, draft_vocab)

    def _set_vocab_maps(self, d2t: torch.Tensor | None, vocab: int, draft_vocab: int) -> None:
        if d2t is None:
            raise EyasError("a reduced draft vocabulary needs its d2t map (run `eyas dump`, which writes vocab.safetensors)")
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        if d2t.numel() != draft_vocab:
            raise EyasError(f"the d2t map has {d2t.numel()} entries but the head's draft vocabulary has {draft_vocab}")
        target_ids = torch.arange(draft_vocab) + d2t
        if target_ids.min() < 0 or target_ids.max() >= vocab:
            raise EyasError(f"the d2t map points outside the target vocabulary (size {vocab}); rebuild it with `eyas dump`")
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def _init_weights(self, std: float) -> None:
        """HF-style init: normal(0, initializer_range) weights, zero biases, unit norms (seeded by the caller)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    # ---- the agreed interface -------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config["num_layers"]

    @property
    def draft_vocab_size(self) -> int:
        return self.config["draft_vocab_size"]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """eagle3: fc over the three fused target layers [.., 3H] -> [.., H]; eagle/mtp: identity."""
        if self.kind == "eagle3":
            return self.fc(features.to(self.fc.weight.dtype))
        return features

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity without a reduced vocabulary)."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def step(self, k: int, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, past_key_values: Any = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (hidden [B,T,H] pre-final-norm, fed to the next step; logits [B,T,V_draft]).

        `k` selects the layer for mtp (and its KV layer index); eagle/eagle3 use their one
        layer (KV layer index 0) for every k. `attention_mask`: None = causal over the given
        tokens (continuing `past_key_values` if it holds any), or a 4D bool/additive mask
        [B,1,T,S] with S = cached + new. `past_key_values`: a transformers Cache (e.g.
        DynamicCache), or a `TTTCache` for the training-time-test unroll.
        """
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        embeds = self.embed_tokens(input_ids)
        feature = feature.to(embeds.dtype)
        cos, sin = self.rotary_emb(feature, position_ids)
        if self.kind == "eagle3":
            hidden = self.midlayer(embeds, feature, cos, sin, attention_mask, past_key_values, 0)
            return hidden, self.lm_head(self.norm(hidden))
        if self.kind == "eagle":
            x = self.fc(torch.cat([embeds, feature], dim=-1))
            hidden = self.layers[0](x, cos, sin, attention_mask, past_key_values, 0)
            return hidden, self.lm_head(hidden)  # EAGLE-1 regresses the post-norm feature: no final norm
        if not 0 <= k < self.num_layers:
            raise IndexError(f"mtp head has {self.num_layers} layers; step {k} does not exist")
        layer = self.layers[k]
        hidden = layer(embeds, feature, cos, sin, attention_mask, past_key_values, k)
        return hidden, self.lm_head(layer.norm(hidden))

    def forward(self, batch: dict, teacher: Any, steps: int, mix: dict, token_feed: str = "draft",
                feature_loss: bool = False, teacher_top: torch.Tensor | None = None) -> dict:
        """The training/eval unroll (`eyas.train.ttt.unroll`) as the module's forward.

        Going through forward() is what lets DDP, FSDP and DeepSpeed hook the backward and
        accelerate apply autocast. Returns a dict of per-step lists (see `UnrollResult`).
        """
        from eyas.train.ttt import unroll

        result = unroll(self, batch, teacher, steps, mix, token_feed=token_feed, feature_loss=feature_loss,
                        teacher_top=teacher_top)
        return {"loss_sums": result.loss_sums, "counts": result.counts, "correct": result.correct,
                "feature_loss_sum": result.feature_loss_sum}

    # ---- initialisation from the target ---------------------------------------------------

    def init_from_target(self, target_model: nn.Module) -> "DraftHead":
        """Copy (and freeze) the target's embedding, lm_head and final norm into the head."""
        embed = target_model.get_input_embeddings().weight
        head = target_model.get_output_embeddings().weight
        norm = _final_norm_weight(target_model)
        return self.init_from_target_weights(embed, head, norm)

    @torch.no_grad()
    def init_from_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor,
                                 norm: torch.Tensor | None) -> "DraftHead":
        """The same from bare tensors (the trainer reads them from the target's safetensors)."""
        hidden, vocab = self.config["hidden_size"], self.config["vocab_size"]
        for name, w in (("embedding", embed), ("lm_head", lm_head)):
            if tuple(w.shape) != (vocab, hidden):
                raise EyasError(f"the target's {name} is {tuple(w.shape)}, the head expects {(vocab, hidden)}; "
                                "is draft built for another target?")
        self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
        rows = torch.arange(vocab) if self.d2t is None else self.draft_to_target(torch.arange(self.draft_vocab_size))
        self.lm_head.weight.copy_(lm_head[rows.to(lm_head.device)].to(self.lm_head.weight.dtype))
        if self.kind == "eagle3" and norm is not None:
            self.norm.weight.copy_(norm)
        if self.kind == "mtp" and norm is not None:
            for layer in self.layers:
                layer.norm.weight.copy_(norm)
        return self


def _final_norm_weight(target_model: nn.Module) -> torch.Tensor | None:
    base = getattr(target_model, "model", target_model)
    norm = getattr(base, "norm", None)
    return None if norm is None else norm.weight


def build_head(draft_cfg: Any, target_config: Any, aux_layers: list[int] | None = None,
               d2t: torch.Tensor | None = None, target_identity: str = "") -> DraftHead:
    """The agreed constructor: a head for `draft_cfg` shaped on `target_config`.

    `d2t` (draft id -> offset to target id) selects the reduced draft vocabulary of eagle3 and
    mtp heads; it is ignored for eagle and when `draft.use_draft_vocab` is false.
    """
    if draft_cfg.kind == "eagle3" and not aux_layers:
        from eyas.config import default_layers

        aux_layers = default_layers(int(target_config.num_hidden_layers))
    use_vocab = uses_draft_vocab(draft_cfg) and d2t is not None
    cfg = head_config(draft_cfg, target_config, aux_layers, len(d2t) if use_vocab else None, target_identity)
    return DraftHead(cfg, d2t if cfg["draft_vocab_size"] != cfg["vocab_size"] else None)


def build_head_from_config(cfg: dict, d2t: torch.Tensor | None = None) -> DraftHead:
    """Rebuild a head from a saved config.json dict (used by `load_draft`)."""
    if cfg.get("format") != "eyas-draft" or cfg.get("kind") not in KINDS:
        raise EyasError("config.json is not an eyas draft config (no format 'eyas-draft' or unknown kind)")
    if int(cfg.get("format_version", 0)) > HEAD_FORMAT_VERSION:
        raise EyasError(f"this draft was written by a newer eyas (format {cfg['format_version']}); upgrade eyas")
    return DraftHead(cfg, d2t)


def count_parameters(head: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in head.parameters())
    return sum(p.numel() for p in head.parameters() if p.requires_grad), total

