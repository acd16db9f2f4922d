"""`train.source: online`: the frozen target computes the features of every batch in the loop.

For users without the disk for shards: batches come from the prepared data (`eyas prepare`)
through the same TokenBudgetLoader the shards use (same order, same exact resume), and the
target's decoder runs over each batch with the dump stage's own `HiddenCapture`, so the
features are the very tensors a dump would have stored (before encoding).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eyas.data.dump import HiddenCapture
from eyas.draft.features import FUSED_LAYERS, LAST_HIDDEN


class PreparedReader:
    """A prepared `datasets.Dataset` seen through the ShardReader interface the loader uses."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._lengths = np.asarray([len(ids) for ids in dataset["input_ids"]], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        row = self.dataset[int(i)]
        return {"input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
                "loss_mask": torch.as_tensor(row["loss_mask"], dtype=torch.float32)}


class OnlineFeatures:
    """Adds the fused layers (the kinds that read them) and the last hidden state to a batch by running
    the frozen target, under the batch keys the shards give them (eyas.draft.features)."""

    def __init__(self, model: Any, aux_layers: list[int]) -> None:
        self.model = model
        self.aux_layers = list(aux_layers)
        self.capture = HiddenCapture(model, self.aux_layers)

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        aux, last = self.capture(batch["input_ids"])
        batch = dict(batch)
        if self.aux_layers:
            batch[FUSED_LAYERS.name] = torch.cat(aux, dim=-1).float()
        batch[LAST_HIDDEN.name] = last.float()
        return batch

    def close(self) -> None:
        self.capture.close()
