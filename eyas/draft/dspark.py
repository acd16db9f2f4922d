"""`dspark` (DSpark): the DFlash block drafter with its anchor row predicting, a Markov head that conditions each
drafted token on the one before it, and a confidence head that says how likely each draft is accepted.

The block is the anchor x_p (the last verified token) at position p and K-1 mask rows at p+1..p+K-1, K =
`draft.num_steps`; every row predicts, row k the token after its own position, x_{p+k+1}, so one forward gives K
drafts (a DFlash block of K+1 rows gives K: `first_predicting_row` 0). The backbone is the block layout's, as
DFlash's is (`eyas.draft.block_layout.BlockHead`: the context is the target's three fused layers through `fc` and
`hidden_norm`, Qwen3 layers, non-causal inside the block), and the mask rows carry the target's own embedding row of
`mask_token_id` (frozen: vLLM's DSpark loader drops a mask vector). On top of each row's final-normed hidden h_k:

- the Markov head, a low-rank bias from the token at the row's own position (what the step before drafted; the
  anchor for row 0): logits_k = lm_head(h_k) + W2 W1[x_{p+k}], W1 an embedding over the target's vocabulary
  [V, r] and W2 a map to the draft vocabulary [V_draft, r] (`draft.markov_rank` r, 256 by default). Training reads
  the data's token there (teacher forcing); eyas's decoder reads each tree node's own token, so the children of
  siblings differ, and its trees and chains are exact for it (`eyas.eval.head_draft.BlockDraft`);
- the confidence head, c_k = sigmoid(w . [h_k; W1[x_{p+k}]] + b), trained by the `confidence` loss towards the
  step's acceptance rate 1 - tv(draft, target) (`eyas.train.losses.confidence_loss`); the head declares
  `gives_confidence`, so eval may cut a chain by it (`chain:K,confidence=C`).

Training (the block layout, `eyas.train.ttt.block_steps`): every position t anchors a block at x_{t+1}, and row k
is unroll step k, predicting x_{t+k+2}; the registry line gives DSpark's published loss when the recipe sets none:
0.1 ce + 0.9 tv + 1.0 confidence, each step weighted exp(-k/4) (`train.ttt_decay` 0.7788).

Export (`--to vllm`): speculators' `dspark` format, as speculators 0.9.0 writes it (`DSparkSpeculatorConfig`) and
vLLM 0.32 reads it (`transformers_utils/configs/speculators/algos.py` `update_dspark`,
`model_executor/models/qwen3_dspark.py`; facts read there, no code copied): `speculators_model_type: dspark`,
`transformer_layer_config` (the Qwen3 layer), `draft_vocab_size`, `block_size` K, `target_hidden_size`,
`aux_hidden_state_layer_ids` (HF hidden_states indices, as eyas's fused layers; vLLM subtracts one),
`mask_token_id`, and written out because vLLM defaults them otherwise: `sample_from_anchor: true` (the anchor row
predicts), `markov_rank`, `markov_head_type: vanilla`, `enable_confidence_head: true`,
`confidence_head_with_markov: true`. Weights: the backbone's names, as DFlash's (`block_layout.backbone_shapes`),
`lm_head.weight` (always: eyas trains it, and a reduced vocabulary needs it), `d2t`/`t2d` for a reduced vocabulary,
`markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`, `confidence_head.proj.{weight,bias}`; no
embed_tokens and no mask vector (both are the target's). vLLM 0.32 runs DSpark only on its V2 model runner (README, engine table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from eyas.draft import block_layout
from eyas.draft.block_layout import BlockHead
from eyas.draft.config import HeadConfig
from eyas.draft.formats import ExportContext, FormatSpec, KindExport, speculators_fields
from eyas.draft.kinds import KindRules, option
from eyas.draft.layouts import BLOCK
from eyas.errors import EyasError

VLLM_ARCHITECTURE = "DSparkSpeculator"


class MarkovHead(nn.Module):
    """The low-rank bias W2 W1[token] [.., V_draft] of the token before each drafted one."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)

    def forward(self, prev_embedding: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(prev_embedding)


class ConfidenceHead(nn.Module):
    """The logit of the probability that a row's draft is accepted, from [h; W1[previous token]]."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, rows: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([rows, prev_embedding.to(rows.dtype)], dim=-1)).squeeze(-1)


# ----------------------------------------------------------------------------- export


def _shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
    rank = _rank(cfg)
    return {**block_layout.backbone_shapes(cfg, bias), "markov_head.markov_w1.weight": (cfg.vocab_size, rank),
            "markov_head.markov_w2.weight": (cfg.draft_vocab_size, rank),
            "confidence_head.proj.weight": (1, cfg.hidden_size + rank), "confidence_head.proj.bias": (1,)}


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    return {
        "architectures": [VLLM_ARCHITECTURE],
        **speculators_fields("dspark", ctx),
        "transformer_layer_config": block_layout.layer_fields(cfg, ctx),
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.num_steps,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "mask_token_id": cfg.mask_token_id,
        # written out: vLLM reads an absent sample_from_anchor / confidence_head_with_markov as false
        "sample_from_anchor": True,
        "markov_rank": _rank(cfg),
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "torch_dtype": ctx.dtype,
        "eyas": ctx.provenance,
    }


def _read_config(config: dict) -> dict:
    ours = {"sample_from_anchor": True, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True}
    if any(config.get(key) != value for key, value in ours.items()):
        raise EyasError("this dspark export is not the variant eyas trains (sample_from_anchor, a vanilla Markov "
                        "head and a confidence head over [hidden; Markov embedding]); eyas reads back only its own")
    layer = config["transformer_layer_config"]
    return {"layer": layer, "num_layers": int(layer["num_hidden_layers"]), "num_steps": int(config["block_size"]),
            "draft_vocab_size": int(config.get("draft_vocab_size") or layer["vocab_size"]),
            "aux_layers": list(config["aux_hidden_state_layer_ids"]), "mask_token_id": int(config["mask_token_id"]),
            "train_mask_embedding": False, "kind_options": {"markov_rank": int(config["markov_rank"])}}


# what `vllm serve` of a dspark export says on a CPU (README, engine table)
_UNSERVED = ("vLLM 0.32 drafts DSpark only on its V2 model runner, which needs Triton (no CPU backend), so no engine "
             "served this format in eyas's tests; its config.json is checked against vLLM's own speculators reader")


def _check_steps(cfg: HeadConfig, steps: int) -> None:
    if steps > cfg.num_steps:
        raise EyasError(f"the DSpark draft was trained with blocks of {cfg.num_steps} drafts; it cannot draft {steps} "
                        f"tokens per round: export with --num-speculative-tokens {cfg.num_steps} or fewer")


EXPORT = KindExport(
    # no mask vector in the weights (vLLM's loader drops one): read back, the mask rows carry the target's row
    formats={"vllm": FormatSpec(VLLM_ARCHITECTURE, "dspark", _shapes, _vllm_config, prepare=block_layout.without_mask,
                                restore=block_layout.target_mask_row, check_steps=_check_steps,
                                read_config=_read_config, engine_model="Qwen3DSparkForCausalLM",
                                engine_unchecked=_UNSERVED,
                                # speculators' own save_pretrained names its model class, not the config's default
                                aliases=("DSparkDraftModel",))},
    from_target=block_layout.FROM_TARGET,
    check=block_layout.check_fused_layers,
    default_steps=block_layout.default_steps,
)


def _rank(cfg: HeadConfig) -> int:
    return int(cfg.kind_options["markov_rank"])

# ----------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class DSparkOptions:
    """dspark's own recipe keys."""

    num_layers: int = option("dspark: decoder layers of the draft stack.", 1, positive=True)
    mask_token_id: int = option("dspark: the token of the mask rows (the target's embedding of it, frozen); -1: the "
                                "target's last vocabulary id.", -1)
    markov_rank: int = option("dspark: the rank r of the Markov head's bias W2 W1[previous token] (W1 [vocab, r], "
                              "W2 [draft vocab, r]).", 256, positive=True)


class DSparkHead(BlockHead):
    kind = "dspark"
    layout = BLOCK  # the block layout's backbone, its anchor row predicting too, a Markov bias and a confidence
    rules = KindRules(title="DSpark", trains_lm_head=True, options=DSparkOptions, losses=("confidence",))
    export = EXPORT
    first_predicting_row: ClassVar[int] = 0  # every row predicts, the anchor's too
    gives_confidence: ClassVar[bool] = True

    @classmethod
    def head_config(cls, draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity) -> HeadConfig:
        cfg = super().head_config(draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity)
        return dataclasses.replace(cfg, kind_options={"markov_rank": cls.recipe_options(draft_cfg).markov_rank})

    def _build(self, cfg: HeadConfig) -> None:
        super()._build(cfg)
        rank = _rank(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, rank)
        self.confidence_head = ConfidenceHead(cfg.hidden_size + rank)

    def slot_logits(self, rows: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rows) + self.markov_head(self.markov_head.markov_w1(prev_tokens)).to(rows.dtype)

    def slot_confidence(self, rows: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.confidence_head(rows, self.markov_head.markov_w1(prev_tokens))
