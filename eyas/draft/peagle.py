"""`peagle` (P-EAGLE): an EAGLE-3 head that drafts all K tokens in one forward, from mask slots.

Step 0 is EAGLE-3's (the target's fused feature through `fc`, the next token); every step k > 0
reads, instead of the previous step's hidden and drafted token, one learned feature and one token:
`mask_hidden` [3H] (a fused-layer-wide vector, through the same `fc`) and `mask_token_id` (the
target's embedding of it, frozen). The attention is the training-time test's (step k at slot t sees
the context up to t and its own slot's earlier steps), so training is the TTT unroll with the mask
inputs (`mask_slots`), and at inference the K steps' inputs are known before any is drafted: vLLM
runs the bonus slot and the K-1 mask slots in one forward. eyas's eval runs them the same way
(the parallel-slots adapter, `eyas.eval.head_draft.ParallelSlotsDraft`: step 0 at commit, then the
mask slots of every depth in one forward), with the same inputs and masks, so the drafts are the
same.

Export (`--to vllm` only), checked against vLLM 0.32's
`transformers_utils/configs/speculators/{base,algos}.py` (the `peagle` speculators type: method
eagle3 with `parallel_drafting`, `mask_token_id` read as the proposer's `pard_token`,
`norm_before_residual` defaulting to false) and `model_executor/models/llama_eagle3.py` (a
`mask_hidden` tensor of fc's input width, loaded into a buffer and passed through
`combine_hidden_states` - input_norm if any, then fc - by the proposer): EAGLE-3's vLLM layout,
`speculators_model_type: peagle`, `mask_token_id`, and `mask_hidden` [1, 3H]. Served with
`{"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eyas.draft import eagle3
from eyas.draft.config import HeadConfig
from eyas.draft.formats import ExportContext, FormatSpec, KindExport
from eyas.draft.head import with_mask_token
from eyas.draft.kinds import KindRules, option
from eyas.draft.layouts import PARALLEL_SLOTS

VLLM_ARCHITECTURE = "PEagleSpeculator"
_EAGLE3_VLLM = eagle3.EXPORT.formats["vllm"]  # the layout peagle extends


def _shapes(cfg: HeadConfig, bias: bool) -> dict[str, tuple]:
    return {**_EAGLE3_VLLM.shapes(cfg, bias), "mask_hidden": (1, 3 * cfg.hidden_size)}


def _vllm_config(cfg: HeadConfig, ctx: ExportContext) -> dict:
    config = _EAGLE3_VLLM.config(cfg, ctx)
    config.update(architectures=[VLLM_ARCHITECTURE], speculators_model_type="peagle", mask_token_id=cfg.mask_token_id)
    config["speculators_config"]["algorithm"] = "peagle"
    return config


def _read_config(config: dict) -> dict:
    return {**_EAGLE3_VLLM.read_config(config), "mask_token_id": int(config["mask_token_id"])}


def _to_engine_rows(state: dict, cfg: HeadConfig) -> dict:
    return {**state, "mask_hidden": state["mask_hidden"].reshape(1, -1)}


def _from_engine_rows(state: dict, cfg: HeadConfig) -> dict:
    return {**state, "mask_hidden": state["mask_hidden"].reshape(-1)}


EXPORT = KindExport(
    formats={"vllm": FormatSpec(VLLM_ARCHITECTURE, "eagle3", _shapes, _vllm_config, biases=_EAGLE3_VLLM.biases,
                                to_engine=_EAGLE3_VLLM.to_engine, to_eyas=_EAGLE3_VLLM.to_eyas,
                                prepare=_to_engine_rows, restore=_from_engine_rows,
                                speculative_extra={"parallel_drafting": True}, read_config=_read_config,
                                engine_model=_EAGLE3_VLLM.engine_model)},  # vLLM builds P-EAGLE in its EAGLE-3 class
    from_target=eagle3.EXPORT.from_target,
    check=eagle3.EXPORT.check,
)


@dataclass(frozen=True)
class PEagleOptions:
    """peagle's own recipe key."""

    mask_token_id: int = option("peagle: the token the mask slots read (its embedding, frozen); -1: the target's "
                                "last vocabulary id.", -1)


class PEagleHead(eagle3.Eagle3Head):
    kind = "peagle"
    layout = PARALLEL_SLOTS  # EAGLE-3's layer, every step k > 0 reading a mask slot (`mask_slots`)
    # EAGLE-3 drafting its steps from mask slots, all in one forward
    rules = KindRules(title="P-EAGLE", trains_lm_head=True, attention_bias_from_target=False, options=PEagleOptions)
    export = EXPORT

    @classmethod
    def head_config(cls, draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity) -> HeadConfig:
        cfg = super().head_config(draft_cfg, target_config, aux_layers, draft_vocab_size, target_identity)
        return with_mask_token(cfg, cls.recipe_options(draft_cfg).mask_token_id)

    def _build(self, cfg: HeadConfig) -> None:
        super()._build(cfg)
        self.mask_hidden = nn.Parameter(torch.zeros(3 * cfg.hidden_size))

    def mask_slots(self, tokens: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (tokens, feature) every step k > 0 reads, shaped as the `tokens` and `feature` it replaces: the
        mask token and fc(mask_hidden), whatever was drafted (`eyas.draft.layouts.PARALLEL_SLOTS`)."""
        ids = torch.full_like(tokens, self.config.mask_token_id)
        mask_feature = self.project(self.mask_hidden[None]).to(feature.dtype)[0]
        return ids, mask_feature.expand_as(feature)
