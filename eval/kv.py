"""KV-cache and attention-mask helpers for tree verification with HF models.

transformers passes a 4D attention mask through untouched (`masking_utils` returns any 4D
tensor as it is), so the tree mask is built here as an additive float mask
[1, 1, new, cached + new] in the model's dtype: 0 where a query may attend, the dtype's
minimum elsewhere. sdpa and eager attention both take it; flash-attention-2 cannot.
Pruning keeps the accepted path by moving its entries next to the prefix and slicing the
rest off; the prefix is never recomputed.
"""

from __future__ import annotations

import torch

from eyas.errors import EyasError


def check_attention(model) -> None:
    """The decoder needs full-attention layers (prunable caches) and a kernel that takes a 4D mask."""
    sliding = [t for t in (getattr(model.config, "layer_types", None) or []) if t != "full_attention"]
    if sliding:
        raise EyasError(f"the target has {len(sliding)} '{sliding[0]}' layers; the eval decoder prunes full-attention "
                        "KV caches only (sliding-window and linear-attention targets are not supported yet)")
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl not in ("sdpa", "eager"):
        raise EyasError(
            f"tree verification needs a custom attention mask; the target uses attn_implementation={impl!r}: "
            "set target.attn_implementation=sdpa (or eager) for eval"
        )


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool [new, total] (True = may attend) -> additive [1, 1, new, total] mask."""
    zero = torch.zeros((), dtype=dtype, device=device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(visible.to(device), zero, blocked)[None, None]


def tree_mask(prefix: int, tree_visible: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Mask for `new` tree tokens after `prefix` cached ones: all of the prefix plus `tree_visible`."""
    new, width = tree_visible.shape
    visible = torch.cat([torch.ones(new, prefix, dtype=torch.bool), tree_visible.cpu()], dim=1)
    return additive_mask(visible, dtype, device)


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
