"""Token-budget batches: the rule `eyas dump` cuts each shard's batches with, and the trainer cuts its
own with too (`eyas.train.loader`, and the held-out batches of `eyas.train.evaluation`).

It lives in the data stage because the dump, the first stage to use it, may not import the trainer
(the stages import one way: data -> train -> eval).
"""

from __future__ import annotations

import numpy as np


def budget_batches(order: np.ndarray, lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Greedy batches over `order` (already sorted longest first): padded size <= token_budget.

    A sample longer than the budget forms a batch of its own.
    """
    batches, start, longest = [], 0, 0
    for pos in range(len(order)):
        length = int(lengths[order[pos]])
        new_longest = max(longest, length)
        if pos > start and new_longest * (pos - start + 1) > token_budget:
            batches.append(order[start:pos])
            start, new_longest = pos, length
        longest = new_longest
    if start < len(order):
        batches.append(order[start:])
    return batches
