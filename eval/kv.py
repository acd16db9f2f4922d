"""KV-cache and attention-mask helpers for tree verification with HF models.

transformers passes a 4D attention mask through untouched (`masking_utils` returns any 4D
tensor as it is), so the tree mask is built here as an additive float mask
[1, 1, new, cached + new] in the model's dtype: 0 where a query may attend, the dtype's
minimum elsewhere. sdpa and eager attention both take it; flash-attention-2 cannot.
Sliding-window layers (gpt-oss, Gemma 3, Mistral, Qwen2 with `use_sliding_window`) get a mask of
their own that also hides keys `sliding_window` or more positions behind the query, measured in
positions (a tree node sits at its root's position + depth), exactly as transformers' own sliding
mask hides them; a model with both kinds of layer takes the two masks as a dict keyed by layer
type, the form its forward looks them up in. The cache keeps every layer's full history (a plain
`DynamicCache`), so pruning works alike on both kinds and the window is the mask's alone.
Pruning keeps the accepted path by moving its entries next to the prefix and slicing the
rest off; the prefix is never recomputed.

`row_invariant_attention` pins sdpa's math kernel for a bf16/fp16 target on a CPU, for the
decoder and its target-alone reference, so that a verify over n tokens computes each row as a
single-token step does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from eyas.errors import EyasError
from eyas.targets import FULL, SLIDING, attention_kinds, check_layer_kinds


def check_attention(model) -> None:
    """The decoder needs full or sliding-window attention layers and a kernel that takes a 4D mask."""
    check_layer_kinds(model.config)
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl not in ("sdpa", "eager"):
        raise EyasError(
            f"tree verification needs a custom attention mask; the target uses attn_implementation={impl!r}: "
            "set target.attn_implementation=sdpa (or eager) for eval"
        )


def row_invariant_attention(device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """A bf16/fp16 target on a CPU: sdpa's math kernel for every attention call in the block; else nothing.

    torch's CPU flash-attention kernel rounds a query row differently depending on how many rows
    the call carries, so in bf16 a verify over n tokens and n single-token steps disagree now and
    then, and bf16 rounding turns a near-tie into another token (tiny Qwen2, 18 prefix lengths:
    7 verifies differ from the steps with flash, 0 with the math kernel; tiny Llama and Qwen2,
    160 bf16 decodes: 117 equal to the bf16 target's greedy decode with flash, 160 with math).
    Not a guarantee: a verify row also sums over the masked positions of later tree nodes, which a
    single step does not have, so a last bit can still differ (tests/test_eval_precision.py; on
    SmolLM2 in bf16 only 2 and 4 of 8 eval outputs matched, docs/results.md). In
    fp32 the kernels' last-bit differences have not turned a token in any run (every fp32 output
    matched), so fp32 keeps the default kernels; GPU kernels are not row-invariant either way, so
    nothing is pinned there.
    """
    if torch.device(device).type != "cpu" or dtype == torch.float32:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool [new, total] (True = may attend) -> additive [1, 1, new, total] mask."""
    zero = torch.zeros((), dtype=dtype, device=device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(visible.to(device), zero, blocked)[None, None]


def tree_mask(config, prefix: int, tree_visible: torch.Tensor, depths: list[int], dtype: torch.dtype, device):
    """The verify forward's mask for `new` tree tokens after `prefix` cached ones (all of the prefix plus
    `tree_visible`), node i at position prefix + depths[i]: one tensor where every layer is of one kind and
    the model takes a tensor, else {layer type: mask}."""
    new, width = tree_visible.shape
    visible = torch.cat([torch.ones(new, prefix, dtype=torch.bool), tree_visible.cpu()], dim=1)
    query = prefix + torch.tensor(depths, dtype=torch.long)
    key = torch.cat([torch.arange(prefix), query])
    return layer_masks(config, visible, query[:, None] - key[None, :], lambda v: additive_mask(v, dtype, device))


def layer_masks(config, visible: torch.Tensor, distance: torch.Tensor, additive: Callable[[torch.Tensor], torch.Tensor]):
    """A forward's attention mask from `visible` (bool, True = the query may attend the key) and each query's
    `distance` to each key in positions (same shape): `additive(visible)` where every layer is full, else a
    sliding layer's mask also hides keys `sliding_window` or more positions behind, as transformers'
    `sliding_window_overlay` does; one tensor where every layer is sliding and the model takes a tensor
    (Mistral, no `layer_types`), else {layer type: mask}."""
    kinds = set(attention_kinds(config))
    if kinds == {FULL}:
        return additive(visible)
    in_window = distance < int(config.sliding_window)
    masks = {kind: additive(visible & in_window if kind == SLIDING else visible) for kind in kinds}
    if not getattr(config, "layer_types", None):  # every layer sliding, one mask (Mistral)
        return masks[SLIDING]
    return masks


def keep_positions(cache, prefix: int, offsets: list[int]) -> None:
    """Keep cache entries [0, prefix) and prefix + offsets (ascending), drop the rest, in place."""
    if cache is None:
        return
    kept = len(offsets)
    index = None
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or keys.numel() == 0:
            continue
        if offsets != list(range(kept)):  # something to move (else the path is already in place)
            if index is None or index.device != keys.device:
                index = torch.tensor([prefix + o for o in offsets], dtype=torch.long, device=keys.device)
            keys[..., prefix:prefix + kept, :] = keys.index_select(-2, index)
            values[..., prefix:prefix + kept, :] = values.index_select(-2, index)
        layer.keys = keys[..., : prefix + kept, :]
        layer.values = values[..., : prefix + kept, :]
