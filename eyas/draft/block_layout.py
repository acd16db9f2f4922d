"""The block layout's head (`eyas.draft.layouts.BLOCK`): what every kind that drafts a block in one forward shares.

The block is the anchor token (the last verified one, at position a) and mask rows at a+1, a+2, ...; a predicting
row gives one draft step. Every layer's queries are the block's rows; its keys and values are the block's own rows
(all of them: non-causal inside the block) and the context, which is not run through the stack: the target's three
fused layers at positions 0..a-1 go through `fc` and `hidden_norm` once, and each layer projects them with its own
k/v projections (k_norm and RoPE at the context positions). The layers are Qwen3-style (q/k RMSNorm per head), the
embedding is the target's (frozen), the lm_head starts from the target's rows (over the reduced draft vocabulary
with `draft.use_draft_vocab`), and the mask rows carry one vector, `mask_embedding` (started from the embedding row
of `mask_token_id`; any row whose token is mask_token_id takes it, the anchor included, as vLLM does).

`BlockHead` is that backbone and the layout's contract, which the stages call and nothing else: the training
scoring (`eyas.train.ttt`, `training_rows`), the eval adapters (`eyas.eval.head_draft.BlockDraft`,
`eyas.eval.batched.BatchedBlockDraft`: `context`, `block_rows`) and both (`slot_logits`, `slot_confidence`). A block
kind (dflash, dspark) subclasses it and declares where it differs:

- `first_predicting_row`: the block's first row that predicts (1: only the mask rows; 0: the anchor row too);
- `gives_confidence`: its `slot_confidence` gives the probability that each drafted token is accepted;
- `slot_logits` / `slot_confidence`: how a row becomes logits (and a confidence), reading the token at the row's own
  position where the kind reads one;
- `trains_mask_embedding`: whether the mask vector trains (else it keeps the target's row, frozen);
- its own recipe keys (`rules.options`), which hold `num_layers` and `mask_token_id` at least.

The pieces of an export the block kinds share are here too: the backbone's tensors (`backbone_shapes`), its Qwen3
layer's config.json fields (`layer_fields`), the mask vector left out of the weights (`without_mask`) and read back
as the target's row (`target_mask_row`), the tensors the engines take from the target (`FROM_TARGET`), the check of
the fused layers (`check_fused_layers`) and the default step count (`default_steps`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from eyas.draft import eagle3
from eyas.draft.blocks import mlp, rms_norm
from eyas.draft.config import HeadConfig
from eyas.draft.features import FUSED_LAYERS
from eyas.draft.formats import ExportContext, attention_shapes, mlp_shapes, rope_fields
from eyas.draft.head import DraftHead, with_mask_token
from eyas.draft.layouts import BLOCK
from eyas.errors import EyasError

# ----------------------------------------------------------------------------- the layers


class BlockAttention(nn.Module):
    """q/k/v/o projections with a per-head RMSNorm on q and k (Qwen3), over the block and a context."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values of rows x [B, N, H]: each [B, kv_heads, N, D]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.kv_heads))
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        return k, self._heads(self.v_proj(x), self.kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor, rows: int) -> torch.Tensor:
        """x [B, A*rows, H]: A blocks of `rows` rows each. Each block attends to the context keys its
        `visible` row [A, S] allows and to all of its own rows."""
        bsz, n, _ = x.shape
        blocks = n // rows
        q = self.q_norm(self._heads(self.q_proj(x), self.heads))
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        out = block_attention(q, k, v, *context, visible, blocks, self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, self.heads * self.head_dim))

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        bsz, n, _ = x.shape
        return x.view(bsz, n, heads, self.head_dim).transpose(1, 2)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                    visible: torch.Tensor, blocks: int, scale: float) -> torch.Tensor:
    """Softmax over [visible context keys, the block's own keys] for every query row.

    q [B, h, A*J, D]; k, v [B, kv, A*J, D] (the blocks' rows); ctx_k, ctx_v [B, kv, S, D];
    visible [A, S] bool. Scores are [A, J, S] + [A, J, J] per head: no (A*J + S)-wide mask. The
    query heads are viewed in groups over their shared key/value head (g = h / kv), so the context,
    which grows every round at eval, is never copied per query head."""
    bsz, heads, n, dim = q.shape
    kv_heads, rows = k.shape[1], n // blocks
    dtype = torch.float32
    qb = q.view(bsz, kv_heads, heads // kv_heads, blocks, rows, dim).to(dtype)
    kb, vb = (t.view(bsz, kv_heads, blocks, rows, dim).to(dtype) for t in (k, v))
    ctx_scores = torch.einsum("bkgajd,bksd->bkgajs", qb, ctx_k.to(dtype)) * scale
    ctx_scores = ctx_scores.masked_fill(~visible[None, None, None, :, None, :], float("-inf"))
    own_scores = torch.einsum("bkgajd,bkaid->bkgaji", qb, kb) * scale
    probs = torch.cat([ctx_scores, own_scores], dim=-1).softmax(dim=-1)
    context = ctx_k.shape[2]
    out = torch.einsum("bkgajs,bksd->bkgajd", probs[..., :context], ctx_v.to(dtype))
    out = out + torch.einsum("bkgaji,bkaid->bkgajd", probs[..., context:], vb)
    return out.reshape(bsz, heads, n, dim).to(q.dtype)


class BlockLayer(nn.Module):
    """A pre-norm decoder layer (Qwen3 attention) over the block rows, reading the context's keys/values."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = mlp(cfg)

    def forward(self, h, cos, sin, context, visible, rows):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, visible, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------- what a block kind's export shares


def backbone_shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
    """The backbone's tensors as both engines name them (vLLM's DFlash and DSpark drafts, SGLang's DFlash draft)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple] = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
                                "lm_head.weight": (cfg.draft_vocab_size, h)}
    if cfg.reduced_vocab:
        shapes["d2t"] = (cfg.draft_vocab_size,)
        shapes["t2d"] = (cfg.vocab_size,)
    for i in range(cfg.num_layers):
        layer = f"layers.{i}."
        shapes.update(attention_shapes(cfg, f"{layer}self_attn.", h, bias))
        shapes[f"{layer}self_attn.q_norm.weight"] = (cfg.head_dim,)
        shapes[f"{layer}self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes.update(mlp_shapes(cfg, f"{layer}mlp."))
        shapes[f"{layer}input_layernorm.weight"] = (h,)
        shapes[f"{layer}post_attention_layernorm.weight"] = (h,)
    return shapes


def layer_fields(cfg: HeadConfig, ctx: ExportContext) -> dict:
    """The backbone's Qwen3 layer as config.json fields (`model_type: qwen3`, the sizes, RoPE, the vocabulary)."""
    rope = rope_fields(cfg)
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        # both spellings: transformers 5 reads rope_parameters, and vLLM's Qwen3 defaults a missing theta to 1e6
        **rope, "rope_parameters": {"rope_type": "default", **(rope["rope_scaling"] or {}), "rope_theta": rope["rope_theta"]},
        "vocab_size": cfg.vocab_size,
        "attention_bias": bool(cfg.qkv_bias and cfg.o_bias),
        "tie_word_embeddings": False, "torch_dtype": ctx.dtype,
    }


def without_mask(state: dict, cfg: HeadConfig) -> dict:
    """The weights less the mask vector (an engine gets it another way, or takes the target's row)."""
    return {name: t for name, t in state.items() if name != "mask_embedding"}


def target_mask_row(state: dict, cfg: HeadConfig) -> dict:
    """Read back from an export without a mask vector: the mask rows carry the target's row, as its engine gives them."""
    return {**state, "mask_embedding": state["embed_tokens.weight"][cfg.mask_token_id]}


# the engines share the target's embedding; the lm_head is the draft's own (reduced vocabulary)
FROM_TARGET = frozenset({"embed_tokens.weight"})
# the same fused layers as eagle3's, captured the same way
check_fused_layers = eagle3.EXPORT.check


def default_steps(cfg: HeadConfig) -> int:
    """An export drafts every step its blocks were trained with unless told fewer."""
    return cfg.num_steps


# ----------------------------------------------------------------------------- the head


class BlockHead(DraftHead):
    """The block layout's backbone and contract (see the module docstring); a block kind subclasses it."""

    layout = BLOCK
    feature_spec = FUSED_LAYERS
    supports_draft_vocab = True
    # the block's first row that predicts: 1, its mask rows (row j predicts the token at its own position); 0, the
    # anchor row too (row k predicts the token after its own position)
    first_predicting_row: ClassVar[int]
    # `slot_confidence` gives the probability that each drafted token is accepted (a chain cut by it: chain:K,C)
    gives_confidence: ClassVar[bool] = False

    @classmethod
    def head_config(cls, draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity) -> HeadConfig:
        cfg = super().head_config(draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity)
        options = cls.recipe_options(draft_cfg)
        return dataclasses.replace(with_mask_token(cfg, options.mask_token_id),
                                   train_mask_embedding=cls.trains_mask_embedding(options))

    @classmethod
    def trains_mask_embedding(cls, options: Any) -> bool:
        """Whether the mask vector trains, from the kind's recipe options (False: the target's row, frozen, as the
        kind's engine gives it)."""
        return False

    @classmethod
    def layers_for(cls, draft_cfg: Any) -> int:
        return cls.recipe_options(draft_cfg).num_layers

    def _build(self, cfg: HeadConfig) -> None:
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = rms_norm(cfg)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=cfg.train_mask_embedding)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the three fused target layers [.., 3H] -> [.., H]: the context rows."""
        return self.fc(features.to(self.fc.weight.dtype))

    @property
    def projection(self) -> nn.Linear:
        return self.fc  # over the fused layers, once per forward

    def max_depth(self) -> int:
        return self.config.num_steps

    def final_norms(self) -> list[nn.Module]:
        return [self.norm]

    @torch.no_grad()
    def init_from_target_weights(self, embed, lm_head, norm) -> BlockHead:
        super().init_from_target_weights(embed, lm_head, norm)
        self.mask_embedding.copy_(embed[self.config.mask_token_id].to(self.mask_embedding.dtype))
        return self

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, the mask vector wherever the token is mask_token_id."""
        embeds = self.embed_tokens(input_ids)
        is_mask = (input_ids == self.config.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)

    def context(self, projected: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of context rows (`project`ed features [B, S, H] at `positions` [S])."""
        normed = self.hidden_norm(projected)
        cos, sin = self.rotary_emb(normed, positions[None].expand(normed.shape[0], -1))
        return [layer.self_attn.keys_values(normed, cos, sin) for layer in self.layers]

    def block_rows(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, context: list, visible: torch.Tensor,
                   predictions: int) -> torch.Tensor:
        """The final-normed hidden rows [B, A, predictions, H] of A blocks that predict, each the next draft step:
        anchor tokens [B, A] at `anchor_positions` [A], each block seeing the context rows its `visible` row
        [A, S] allows (and its own rows). `slot_logits` turns a row into logits."""
        bsz, blocks = anchors.shape
        first = self.first_predicting_row
        rows = first + predictions
        ids = torch.full((bsz, blocks, rows), self.config.mask_token_id, dtype=anchors.dtype, device=anchors.device)
        ids[:, :, 0] = anchors
        h = self.embed(ids).view(bsz, blocks * rows, -1)
        positions = (anchor_positions[:, None] + torch.arange(rows, device=anchors.device)).reshape(-1)
        cos, sin = self.rotary_emb(h, positions[None].expand(bsz, -1))
        for layer, layer_context in zip(self.layers, context):
            h = layer(h, cos, sin, layer_context, visible, rows)
        return self.norm(h.view(bsz, blocks, rows, -1)[:, :, first:])

    def slot_logits(self, rows: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of block rows [..., H]; `prev_tokens` [...] are the tokens at the rows' own positions
        (what the step before drafted: the anchor for the first), which the backbone's rows do not read."""
        return self.lm_head(rows)

    def slot_confidence(self, rows: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """The logit [...] of the probability that the token drafted from each row is accepted: a kind that
        declares `gives_confidence` gives it; the stages ask `gives_confidence` before they call this."""
        raise EyasError(f"a {self.kind} draft gives no confidence for its drafts (a dspark draft does)")

    def training_rows(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> torch.Tensor:
        """Rows [B, T, steps, H] whose [:, t, k] is unroll step k at slot t (it predicts x_{t+k+2}): every position t
        is an anchor (token x_{t+1} at t+1, context f_0..f_t) and step k is its block's k-th predicting row."""
        bsz, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device)
        anchors = torch.cat([input_ids[:, 1:], input_ids.new_zeros(bsz, 1)], dim=1)  # the last slot's label is past the end
        visible = positions[None, :] <= positions[:, None]
        return self.block_rows(anchors, positions + 1, self.context(self.project(features), positions), visible, steps)

    def step(self, *args, **kwargs):
        raise EyasError(f"a {self.kind} draft drafts a whole block at once (block_rows); it has no single draft step")
