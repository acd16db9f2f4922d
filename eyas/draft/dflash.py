"""`dflash` (DFlash): a small non-causal stack that drafts a whole block of tokens in one forward.

The block layout's backbone (`eyas.draft.block_layout.BlockHead`: the layers, the context of the target's three
fused layers, the mask vector), as DFlash publishes it: the block is the anchor token (the last verified one, at
position a) followed by K = num_steps mask slots at positions a+1..a+K; slot j predicts the token AT its own
position, x_{a+j} (`first_predicting_row` 1: the anchor row does not predict), from its row alone (no token read,
no confidence). The lm_head is trained unless `draft.train_lm_head: false`, and the mask slots' vector
`mask_embedding` trains unless `draft.train_mask_embedding: false`.

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

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from eyas.draft.block_layout import (
    FROM_TARGET,
    BlockHead,
    backbone_shapes,
    check_fused_layers,
    default_steps,
    layer_fields,
    target_mask_row,
    without_mask,
)
from eyas.draft.config import HeadConfig
from eyas.draft.formats import ExportContext, FormatSpec, KindExport
from eyas.draft.kinds import KindRules, option
from eyas.draft.layouts import BLOCK
from eyas.errors import EyasError

VLLM_ARCHITECTURE = "DFlashDraftModel"  # SGLang names its DFlash draft class the same
MASK_FILE = "mask_embedding.pt"

# ----------------------------------------------------------------------------- export


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    return {
        "architectures": [VLLM_ARCHITECTURE], **layer_fields(cfg, ctx),
        "draft_vocab_size": cfg.draft_vocab_size,
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


def _mask_file(state: dict, cfg: HeadConfig) -> dict[str, Any]:
    return {MASK_FILE: {"mask_token_id": int(cfg.mask_token_id), "embedding": state["mask_embedding"]}}


def _read_mask_file(saved: dict[str, Any], cfg: HeadConfig) -> dict[str, torch.Tensor]:
    found = saved.get(MASK_FILE)
    if found is None:
        raise EyasError(f"a DFlash export needs its {MASK_FILE} (the trained mask vector); export again")
    return {"mask_embedding": found["embedding"].reshape(-1)}


def _sglang_shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
    return {name: shape for name, shape in backbone_shapes(cfg, bias).items() if name != "lm_head.weight"}


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


EXPORT = KindExport(
    formats={"vllm": FormatSpec(VLLM_ARCHITECTURE, "dflash", backbone_shapes, _vllm_config, prepare=without_mask,
                                side_files=_mask_file, read_side_files=_read_mask_file, check_steps=_check_steps,
                                read_config=_read_config, engine_model="DFlashQwen3ForCausalLM"),
             # SGLang's read-back: the mask slots carry the target's row, as that engine gives them
             "sglang": FormatSpec(VLLM_ARCHITECTURE, "DFLASH", _sglang_shapes, _sglang_config, prepare=without_mask,
                                  restore=target_mask_row, check=_check_sglang, check_steps=_check_steps,
                                  from_target=frozenset({"lm_head.weight"}),
                                  sglang_steps="--speculative-num-draft-tokens {tokens}", read_config=_read_sglang_config)},
    from_target=FROM_TARGET,
    check=check_fused_layers,
    default_steps=default_steps,
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


class DFlashHead(BlockHead):
    kind = "dflash"
    layout = BLOCK  # one forward drafts the block; the unroll's step k is the block's mask slot k+1, num_steps slots
    rules = KindRules(title="DFlash", trains_lm_head=True, options=DFlashOptions)
    export = EXPORT
    first_predicting_row: ClassVar[int] = 1  # the mask rows predict, the anchor row does not
    gives_confidence: ClassVar[bool] = False

    @classmethod
    def trains_mask_embedding(cls, options: DFlashOptions) -> bool:
        return options.train_mask_embedding
