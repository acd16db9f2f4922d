"""The reduced draft vocabulary of EAGLE-3: the target tokens the draft may predict.

Token frequencies are counted under the loss mask (the tokens a draft is trained to guess);
the `draft_vocab_size` most frequent tokens form the draft vocabulary, kept in ascending
target-id order (ties broken by the smaller id; when fewer tokens were seen, the unseen ones
with the smallest ids fill the rest, so the size is always what the recipe asks for).

Maps, in the SGLang/EAGLE-3 convention:
- `d2t` int64 [Vd]: target_id = draft_id + d2t[draft_id]
- `t2d` bool [V]: whether a target token is in the draft vocabulary
- `counts` int64 [V]: the frequencies the choice was made from
Stored as `vocab.safetensors` beside the shards; `load_vocab(shard_dir)` reads it back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from eyas.errors import EyasError
from eyas.io import atomic_write_bytes

VOCAB_FILE = "vocab.safetensors"


def count_tokens(dataset, vocab_size: int, batch_size: int = 4096) -> torch.Tensor:
    """Counts of each token id under the loss mask over a prepared dataset (int64 [V])."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(dataset), batch_size):
        batch = dataset[start:start + batch_size]
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in batch["input_ids"]] or [np.zeros(0, np.int64)])
        mask = np.concatenate([np.asarray(x, dtype=bool) for x in batch["loss_mask"]] or [np.zeros(0, bool)])
        if ids.size and ids.max() >= vocab_size:
            raise EyasError(f"prepared token id {int(ids.max())} is outside the target vocabulary ({vocab_size}); "
                            "the data was prepared with another tokenizer: rerun `eyas prepare RECIPE`")
        counts += np.bincount(ids[mask], minlength=vocab_size)
    return torch.from_numpy(counts)


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens (0 or >= V: the full vocabulary)."""
    vocab_size = counts.numel()
    size = vocab_size if draft_vocab_size <= 0 or draft_vocab_size >= vocab_size else draft_vocab_size
    # Sort by count descending, then id ascending (lexsort's last key is the primary one).
    ranked = np.lexsort((np.arange(vocab_size), -counts.numpy()))
    chosen = torch.from_numpy(np.sort(ranked[:size])).long()
    d2t = chosen - torch.arange(size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def write_vocab(shard_dir: str | Path, counts: torch.Tensor, draft_vocab_size: int) -> dict:
    """Build and save vocab.safetensors; returns a summary for the manifest."""
    d2t, t2d = build_vocab(counts, draft_vocab_size)
    atomic_write_bytes(Path(shard_dir) / VOCAB_FILE, save({"d2t": d2t, "t2d": t2d, "counts": counts.long()}))
    total = int(counts.sum())
    covered = int(counts[t2d].sum())
    return {"file": VOCAB_FILE, "draft_vocab_size": int(d2t.numel()), "coverage": covered / total if total else 1.0}


def load_vocab(shard_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) from a dump's vocab.safetensors."""
    path = Path(shard_dir) / VOCAB_FILE
    if not path.is_file():
        raise EyasError(f"no draft vocabulary at '{path}'; run `eyas dump RECIPE` (it writes the vocabulary)")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # a damaged file
        raise EyasError(f"draft vocabulary '{path}' cannot be read ({exc}); rerun `eyas dump RECIPE`") from None
    return tensors["d2t"], tensors["t2d"]
