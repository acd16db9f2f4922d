"""Decoding the target alone, shared by regeneration (data), target-written prompts (data) and eval.

- `SamplingParams` and `process_logits`: the one set of sampling rules (temperature, top-k,
  top-p). Eval applies it to target and draft alike, which is what keeps speculative sampling
  exact; regeneration and prompt writing draw from the same distribution.
- `token_chooser`: a batched `choose(logits) -> token ids` (argmax at temperature 0, else one
  draw per row from `process_logits`).
- `stop_token_ids`: the tokens that end a turn.
- `plain_decode`: a bare KV-cache loop over a left-padded batch in which finished rows leave
  the batch. It is the target in its leanest form: the timed eval baseline (batch 1) and the
  regeneration loop (HF `generate` adds a few percent of per-token overhead here).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from eyas.errors import EyasError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn; the same object shapes target and draft distributions."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or t != t or t < 0 or t == float("inf"):
            raise EyasError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not 0 < self.top_p <= 1:
            raise EyasError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise EyasError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


NUCLEUS_FIRST = 256  # top-p looks at this many best tokens first; a full sort only when they hold < top_p


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> sampling probabilities (float32) after temperature, top-k, top-p.

    top-k keeps the k best tokens; top-p then keeps the smallest prefix (best first) whose mass
    reaches top_p (the first token is always kept). The same function shapes p and q.
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    use_top_k = 0 < params.top_k < vocab
    if not use_top_k and params.top_p >= 1.0:
        return x.softmax(-1)
    kept_set = params.top_k if use_top_k else vocab
    if params.top_p < 1.0 and kept_set > NUCLEUS_FIRST:
        # fast path: the nucleus usually lies within the best few hundred tokens; exact when it does
        values, order = x.topk(NUCLEUS_FIRST, dim=-1)
        pool = x.topk(kept_set, dim=-1).values if use_top_k else x
        probs = (values - pool.logsumexp(-1, keepdim=True)).exp()
        if bool((probs.sum(-1) >= params.top_p).all()):
            return _scatter_kept(x, values, order, probs, params.top_p)
    values, order = x.topk(kept_set, dim=-1)  # sorted, best first
    probs = values.softmax(-1)
    return _scatter_kept(x, values, order, probs, params.top_p)


def _scatter_kept(x: torch.Tensor, values: torch.Tensor, order: torch.Tensor, probs: torch.Tensor,
                  top_p: float) -> torch.Tensor:
    """Softmax over the kept candidates (best first), every other token at probability 0."""
    if top_p < 1.0:
        values = values.masked_fill((probs.cumsum(-1) - probs) >= top_p, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, values).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a probability vector (inverse CDF; cheaper than torch.multinomial per call)."""
    cdf = probs.cumsum(-1)
    u = torch.rand((1,), generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).item())
    if probs[index] <= 0:  # u landed on the float rounding at the very top: take the last token with mass
        index = int(torch.nonzero(probs > 0)[-1].item())
    return index


def token_chooser(params: SamplingParams, generator: torch.Generator | None
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`choose(logits [rows, V]) -> token ids [rows]`: argmax when greedy, else one draw per row."""
    if params.greedy:
        return lambda logits: logits.argmax(-1)
    if generator is None:
        raise ValueError("sampling needs a seeded torch.Generator")

    return lambda logits: torch.multinomial(process_logits(logits, params), 1, generator=generator).squeeze(1)


def seeded_generator(device: Any, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def stop_token_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """The tokens that end a turn: every EOS of the model's generation config and the tokenizer's EOS."""
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos])
    if tokenizer is not None:
        eos.add(tokenizer.eos_token_id)
    eos.discard(None)
    return sorted(int(e) for e in eos)


def left_padded(tokenizer: Any, texts: list[str], device: Any) -> dict:
    """A batch of texts tokenised with padding on the left (what a decode loop continues), without
    changing the tokenizer's padding side or pad token. A tokenizer without a pad token (SmolLM2's
    own, loaded plainly) pads with its EOS: the attention mask hides pad positions, so their id is
    never read."""
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        return tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = None


def left_padded_ids(rows: list[list[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows of different lengths -> (input_ids, attention_mask) [rows, longest], padded on the
    left (what `plain_decode` continues); a pad takes the row's first id, which the mask hides."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[row[0]] * (width - len(row)) + list(row) for row in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long, device=device)
    return ids, mask


def cache_kwarg(model: Any) -> str:
    """The forward() keyword for the KV cache: `cache` in transformers >= 5.x, else `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache() -> DynamicCache:
    return DynamicCache()


@torch.inference_mode()
def plain_decode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_ids: torch.Tensor, choose: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
    """Continue a left-padded batch token by token over the KV cache; new tokens per row (ending with
    the EOS id when one was emitted, as HF `generate` returns them).

    `choose(logits [rows, V] fp32) -> token ids [rows]` picks each step's tokens. Rows that emit
    an EOS id leave the batch (their cache rows are dropped), so a batch costs what its live
    rows need.
    """
    cache = new_cache()
    cache_kw = cache_kwarg(model)
    live = torch.arange(input_ids.shape[0], device=input_ids.device)  # original row of each batch row
    out: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    ids, mask = input_ids, attention_mask
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{cache_kw: cache}).logits[:, -1].float()
        token = choose(logits)
        done = torch.isin(token, eos_ids)
        for row, tok in zip(live.tolist(), token.tolist()):
            out[row].append(tok)
        if done.all():
            break
        if done.any():
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, token, mask, positions = live[keep], token[keep], mask[keep], positions[keep]
        ids = token.unsqueeze(1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
    return out
