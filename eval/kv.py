"""KV-cache and attention-mask helpers for tree verification with HF models.

transformers passes a 4D attention mask through untouched (`masking_utils` returns any 4D
tensor as it is), so the tree mask is built here as an additive float mask
[1, 1, new, cached + new] in the model's dtype: 0 where a query may attend, the dtype's
minimum elsewhere. sdpa and eager attention both take it; flash-attention-2 cannot.
Pruning keeps the accepted path by moving its entries next to the prefix and slicing the
rest off; the prefix is never recomputed.
"""

from __future__ import annotations

import inspect

import torch

from eyas.errors import EyasError


def cache_kwarg(model) -> str:
    """The forward() keyword for the KV cache: `cache` in transformers >= 5.x, else `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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


def new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


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


@torch.inference_mode()
def plain_decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_ids: torch.Tensor, choose) -> list[list[int]]:
    """Continue a left-padded batch token by token over the KV cache; new tokens per row (ending with
    the EOS id when one was emitted, as HF `generate` returns them).

    `choose(logits [rows, V] fp32) -> token ids [rows]` picks each step's tokens. Rows that emit
    an EOS id leave the batch (their cache rows are dropped), so a batch costs what its live
    rows need. This is the target alone in its leanest form: the timed eval baseline (batch 1)
    and the regeneration loop; HF `generate` adds a few percent of per-token overhead.
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
