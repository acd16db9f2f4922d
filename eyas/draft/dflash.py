"""`dflash` (DFlash): a small non-causal stack that drafts a whole block of tokens in one forward.

The block is the anchor token (the last verified one, at position a) followed by K = num_steps
mask slots at positions a+1..a+K; slot j predicts the token AT its own position, x_{a+j}. Every
layer's queries are the block's rows; its keys and values are the block's own rows (all of them:
non-causal inside the block) and the context, which is not run through the stack: the target's
three fused layers at positions 0..a-1 go through `fc` and `hidden_norm` once, and each layer
projects them with its own k/v projections (k_norm and RoPE at the context positions). The layers
are Qwen3-style (q/k RMSNorm per head), the embedding is the target's (frozen), the lm_head starts
from the target's rows (over the reduced draft vocabulary with `draft.use_draft_vocab`, as eagle3's;
trained unless `draft.train_lm_head: false`), and the mask slots carry one trained vector,
`mask_embedding` (started from the embedding row of `mask_token_id`; any row whose token is
mask_token_id takes it, the anchor included, as vLLM does).

Training (`training_rows`, scored by `eyas.train.ttt` for the block layout, `eyas.draft.layouts.BLOCK`): every
position t is an anchor, with token x_{t+1} at position t+1 and the context f_0..f_t, so block
slot k+1 predicts x_{t+k+2}: the token and the teacher of unroll step k at slot t, scored and
weighted (train.ttt_decay**k) exactly as the training-time test scores its steps. One pass, no
unroll: attention is T*(K+1) queries over T context keys plus K+1 block keys.

Export (`--to vllm`), checked against vLLM 0.32's `model_executor/models/qwen3_dflash.py` and
`v1/spec_decode/dflash.py` (facts read there, no code copied): architecture `DFlashDraftModel`,
`model_type: qwen3`, `dflash_config: {mask_token_id, target_layer_ids}` where id j is the OUTPUT
of target layer j (vLLM adds 1 to capture the input of layer j+1: HF hidden_states index j+1, so
eyas's fused indices are written minus one); weights `fc.weight` [H, 3H], `hidden_norm.weight`,
`norm.weight`, `layers.i.self_attn.{q,k,v,o}_proj.weight`, `layers.i.self_attn.{q,k}_norm.weight`
[head_dim], `layers.i.mlp.{gate,up,down}_proj.weight`, `layers.i.{input,post_attention}_layernorm.weight`,
`lm_head.weight` [V_draft, H] with `draft_vocab_size` and `d2t` (`t2d` is skipped) for a reduced
vocabulary (vLLM maps the draft ids to the target's, -inf elsewhere, and shares an lm_head equal
to the target's); no embed_tokens (vLLM shares the target's); the mask vector in `mask_embedding.pt`
({"mask_token_id", "embedding"}), which vLLM substitutes for that token's embedding. No
`layer_types` or `is_causal`: every layer is then full, non-causal attention. Served with
`{"method": "dflash", "num_speculative_tokens": K}`, K <= num_steps.

Export `--to sglang`, checked against SGLang 0.5.23's `srt/models/dflash.py` and
`srt/speculative/dflash_worker_v2.py` (it does not start on a CPU): the same class name, config and
layer weights (it also reads the layer ids as outputs and adds 1), with `block_size` also in
`dflash_config`; but SGLang's draft has no lm_head (it scores with the target's over the full
vocabulary) and it writes a shipped `mask_embedding.pt` into the TARGET's embedding row of the mask
token, which changes the target wherever that token occurs. So SGLang serves exactly only a draft
trained over the full vocabulary with the target's lm_head and mask row frozen
(`draft.use_draft_vocab: false`, `draft.train_lm_head: false`, `draft.train_mask_embedding: false`);
anything else is refused, naming those keys. Served with `--speculative-algorithm DFLASH
--speculative-num-draft-tokens K+1` (SGLang forces num_steps and topk to 1 for DFlash).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from eyas.draft import eagle3
from eyas.draft.blocks import mlp, rms_norm
from eyas.draft.config import HeadConfig
from eyas.draft.features import FUSED_LAYERS
from eyas.draft.formats import ExportContext, FormatSpec, KindExport, attention_shapes, mlp_shapes, rope_fields
from eyas.draft.head import DraftHead, with_mask_token
from eyas.draft.kinds import KindRules, option
from eyas.errors import EyasError

VLLM_ARCHITECTURE = "DFlashDraftModel"  # SGLang names its DFlash draft class the same
MASK_FILE = "mask_embedding.pt"

# ----------------------------------------------------------------------------- the layers


class DFlashAttention(nn.Module):
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


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer (Qwen3 attention) over the block rows, reading the context's keys/values."""

    starts_from_target_layer = True  # train.draft_init=target_last_layer copies the target layer's tensors of its names

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = mlp(cfg)

    def forward(self, h, cos, sin, context, visible, rows):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, visible, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------- export


def _shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
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


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    rope = rope_fields(cfg)
    return {
        "architectures": [VLLM_ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        # both spellings: transformers 5 reads rope_parameters, and vLLM's Qwen3 defaults a missing theta to 1e6
        **rope, "rope_parameters": {"rope_type": "default", **(rope["rope_scaling"] or {}), "rope_theta": rope["rope_theta"]},
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "attention_bias": bool(cfg.qkv_bias and cfg.o_bias),
        "tie_word_embeddings": False, "torch_dtype": ctx.dtype,
        "block_size": cfg.num_steps + 1, "target_hidden_size": cfg.hidden_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [i - 1 for i in cfg.aux_layers]},
        "eyas": ctx.provenance,
    }


def _read_config(config: dict) -> dict:
    dflash = config.get("dflash_config") or {}
    return {"layer": config, "num_layers": int(config["num_hidden_layers"]),
            "num_steps": int(config.get("block_size", 2)) - 1,
            "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
            "aux_layers": [i + 1 for i in dflash.get("target_layer_ids", [])],
            "mask_token_id": int(dflash["mask_token_id"])}


def _read_sglang_config(config: dict) -> dict:
    """SGLang's layout holds only a draft that kept the target's lm_head and mask row (`_check_sglang`)."""
    return {**_read_config(config), "train_lm_head": False, "train_mask_embedding": False}


def _check_steps(cfg: HeadConfig, steps: int) -> None:
    if steps > cfg.num_steps:
        raise EyasError(f"the DFlash draft was trained with {cfg.num_steps} mask slots (block size {cfg.num_steps + 1}); "
                        f"it cannot draft {steps} tokens per round: export with --num-speculative-tokens {cfg.num_steps} "
                        "or fewer")


def _without_mask(state: dict, cfg: HeadConfig) -> dict:
    return {name: t for name, t in state.items() if name != "mask_embedding"}


def _mask_file(state: dict, cfg: HeadConfig) -> dict[str, Any]:
    return {MASK_FILE: {"mask_token_id": int(cfg.mask_token_id), "embedding": state["mask_embedding"]}}


def _read_mask_file(saved: dict[str, Any], cfg: HeadConfig) -> dict[str, torch.Tensor]:
    found = saved.get(MASK_FILE)
    if found is None:
        raise EyasError(f"a DFlash export needs its {MASK_FILE} (the trained mask vector); export again")
    return {"mask_embedding": found["embedding"].reshape(-1)}


def _sglang_shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
    return {name: shape for name, shape in _shapes(cfg, bias).items() if name != "lm_head.weight"}


def _sglang_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    config = _vllm_config(cfg, ctx)
    del config["draft_vocab_size"]
    config["dflash_config"]["block_size"] = cfg.num_steps + 1
    return config


def _check_sglang(cfg: HeadConfig) -> None:
    """SGLang serves exactly only the target's lm_head (full vocabulary) and the target's mask-token row."""
    trained = {"draft.use_draft_vocab=false": cfg.reduced_vocab, "draft.train_lm_head=false": cfg.train_lm_head,
               "draft.train_mask_embedding=false": cfg.train_mask_embedding}
    fixes = [key for key, needed in trained.items() if needed]
    if fixes:
        raise EyasError("SGLang's DFlash draft scores with the target's own lm_head over the full vocabulary, and it "
                        "writes a shipped mask vector into the target's embedding row of the mask token (which changes "
                        "the target wherever that token occurs); this draft trained its own: train it with "
                        f"{' '.join(fixes)} to serve it in SGLang, or export it with --to vllm, which serves it as trained")


def _target_mask_row(state: dict, cfg: HeadConfig) -> dict:
    """Read back from SGLang's layout: the mask slots carry the target's row, as that engine gives them."""
    return {**state, "mask_embedding": state["embed_tokens.weight"][cfg.mask_token_id]}


EXPORT = KindExport(
    formats={"vllm": FormatSpec(VLLM_ARCHITECTURE, "dflash", _shapes, _vllm_config, prepare=_without_mask,
                                side_files=_mask_file, read_side_files=_read_mask_file, check_steps=_check_steps,
                                read_config=_read_config, engine_model="DFlashQwen3ForCausalLM"),
             "sglang": FormatSpec(VLLM_ARCHITECTURE, "DFLASH", _sglang_shapes, _sglang_config, prepare=_without_mask,
                                  restore=_target_mask_row, check=_check_sglang, check_steps=_check_steps,
                                  from_target=frozenset({"lm_head.weight"}),
                                  sglang_steps="--speculative-num-draft-tokens {tokens}", read_config=_read_sglang_config)},
    from_target=frozenset({"embed_tokens.weight"}),
    check=eagle3.EXPORT.check,  # the same fused layers, captured the same way
    default_steps=lambda cfg: cfg.num_steps,
)

# ----------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class DFlashOptions:
    """dflash's own recipe keys."""

    num_layers: int = option("dflash: decoder layers of the draft stack.", 1, positive=True)
    mask_token_id: int = option("dflash: the token of the mask slots (the draft trains a vector in place of its "
                                "embedding, shipped as mask_embedding.pt); -1: the target's last vocabulary id.", -1)
    train_mask_embedding: bool = option(
        "dflash: train the mask slots' vector (started from the target's embedding row of draft.mask_token_id, "
        "shipped as mask_embedding.pt); false keeps the target's row, which an SGLang export needs.", True,
        elsewhere="a {title} draft has no mask vector to freeze (a dflash draft has); remove the key")


class DFlashHead(DraftHead):
    kind = "dflash"
    # one forward drafts the block; the unroll's step k is the block's mask slot k+1, num_steps slots
    rules = KindRules(title="DFlash", trains_lm_head=True, options=DFlashOptions)
    feature_spec = FUSED_LAYERS
    supports_draft_vocab = True
    export = EXPORT

    @classmethod
    def head_config(cls, draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity) -> HeadConfig:
        cfg = super().head_config(draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity)
        options = cls.recipe_options(draft_cfg)
        # a kind on this backbone without the key (dspark) keeps the target's row, as its engine gives it
        return dataclasses.replace(with_mask_token(cfg, options.mask_token_id),
                                   train_mask_embedding=getattr(options, "train_mask_embedding", False))

    @classmethod
    def layers_for(cls, draft_cfg: Any) -> int:
        return cls.recipe_options(draft_cfg).num_layers

    def _build(self, cfg: HeadConfig) -> None:
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = rms_norm(cfg)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=cfg.train_mask_embedding)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the three fused target layers [.., 3H] -> [.., H]: the context rows."""
        return self.fc(features.to(self.fc.weight.dtype))

    def max_depth(self) -> int:
        return self.config.num_steps

    def _final_norms(self) -> list[nn.Module]:
        return [self.norm]

    @torch.no_grad()
    def init_from_target_weights(self, embed, lm_head, norm) -> DFlashHead:
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

    # the block's rows that predict: its mask rows (row j predicts the token at its own position); a kind on this
    # backbone whose anchor row predicts too (dspark) starts at 0
    first_predicting_row: ClassVar[int] = 1

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
        (what the step before drafted: the anchor for the first), which a DFlash row does not read."""
        return self.lm_head(rows)

    def slot_confidence(self, rows: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """The logit [...] of the probability that the token drafted from each row is accepted (None: the kind
        has no confidence head)."""
        return None

    def training_rows(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> torch.Tensor:
        """Rows [B, T, steps, H] whose [:, t, k] is unroll step k at slot t (it predicts x_{t+k+2}): every position t
        is an anchor (token x_{t+1} at t+1, context f_0..f_t) and step k is its block's k-th predicting row."""
        bsz, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device)
        anchors = torch.cat([input_ids[:, 1:], input_ids.new_zeros(bsz, 1)], dim=1)  # the last slot's label is past the end
        visible = positions[None, :] <= positions[:, None]
        return self.block_rows(anchors, positions + 1, self.context(self.project(features), positions), visible, steps)

    def step(self, *args, **kwargs):
        raise EyasError("a DFlash draft drafts a whole block at once (block_rows); it has no single draft step")

