"""Eval's memory model: the target and the draft decoding one prompt at a time, per GPU and per host rank.

Counted from this stage's own decoder (its KV cache, the largest tree of its shapes), so it lives
beside it; `eyas plan` composes it with the dump's and the trainer's, and the types it shares with
them are `eyas.memory`'s.
"""

from __future__ import annotations

from typing import Any

from eyas.memory import CUDA_RUNTIME, DraftSize, Hardware, Need, Shapes, forward_bytes, target_bytes
from eyas.recipe_schema import Recipe
from eyas.shapes import parse_shape


def eval_need(recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware) -> Need:
    """Eval on one device, one prompt at a time: the target and the draft in the target's dtype b.

    device = weights (params + draft params)·b
           + KV cache 2·L·Hkv·b x C, C = data.max_length (a prompt's bound) + eval.max_new_tokens + the
             largest tree of eval.shapes + 1
           + the prompt's prefill, P = data.max_length tokens: `forward_bytes`, the logits P·V·b and every
             layer's hidden state (L + 1)·P·H·b (kept for drafts that read the target's features)
    host: loading, the weights on the CPU first (params·b; on a GPU only)
    """
    b = target_bytes(recipe, hw)
    prompt = recipe.data.max_length
    nodes = max(parse_shape(shape).max_nodes for shape in recipe.eval.shapes)
    context = prompt + recipe.eval.max_new_tokens + nodes + 1
    kv = s.kv_heads * s.head_dim
    device = {"weights": (s.params + d.trainable + d.frozen) * b, "kv cache": 2 * s.layers * kv * b * context,
              "prefill": forward_bytes(s, prompt, b) + prompt * s.vocab * b + (s.layers + 1) * prompt * s.hidden * b}
    host = {}
    if hw.device == "cuda":
        device["cuda runtime"] = CUDA_RUNTIME
        host["loading"] = s.params * b
    return Need("eval", device, host, "data.max_length", [f"one prompt at a time, context up to {context} tokens"])
