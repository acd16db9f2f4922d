"""A run's progress: what changes as it trains, what a checkpoint's trainer.json keeps and a resume restores."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    best_score: float = -1.0  # the held-out figure `best/` was chosen by (`best_by`'s simulated acceptance)
    best_by: str = ""         # the shape whose simulated acceptance chose `best/` (train.select_shape)
    best_step: int = -1
    last_eval: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "best_score": self.best_score, "best_by": self.best_by,
                "best_step": self.best_step, "last_eval": self.last_eval}
