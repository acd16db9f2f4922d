"""Training logs: a progress bar, a JSONL file, and wandb or tensorboard through accelerate.

Rank 0 only. Every logged step goes to `run_dir/logs/metrics.jsonl` (one JSON object per
line, `kind` train or eval) whatever the tracker; `train.logger: wandb` runs offline unless
WANDB_API_KEY is set (files under `run_dir/logs/wandb/`), `tensorboard` writes event files
under `run_dir/logs/tensorboard/`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eyas.io import atomic_write_text


def tracker_settings(recipe: Any) -> tuple[str | None, Path]:
    """(accelerate `log_with`, project dir) for the recipe's logger; sets wandb offline without a key."""
    logs = recipe.run_dir / "logs"
    logger = recipe.train.logger
    if logger == "wandb":
        if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_DIR", str(logs))
        return "wandb", logs
    if logger == "tensorboard":
        return "tensorboard", logs / "tensorboard"
    return None, logs


class MetricsLogger:
    """Progress bar (steps/s, tokens/s, ETA) + metrics.jsonl + the accelerate trackers."""

    def __init__(self, accelerator: Any, recipe: Any, total_steps: int, start_step: int) -> None:
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.logs = recipe.run_dir / "logs"
        self.total = total_steps
        self.bar = None
        self._tokens_since = 0
        self._steps_since = 0
        self._since = time.perf_counter()
        self.last_rates = {"steps_per_s": 0.0, "tokens_per_s": 0.0}
        if recipe.train.logger != "none":
            self.logs.mkdir(parents=True, exist_ok=True)
            init_kwargs = {"wandb": {"dir": str(self.logs), "name": recipe.run.name}} if recipe.train.logger == "wandb" else {}
            accelerator.init_trackers(recipe.train.wandb_project if recipe.train.logger == "wandb" else recipe.run.name,
                                      config=_flat(recipe.to_dict()), init_kwargs=init_kwargs)
        if self.main:
            self.logs.mkdir(parents=True, exist_ok=True)
            drop_rows_after(self.logs / "metrics.jsonl", start_step)
            self.jsonl = open(self.logs / "metrics.jsonl", "a", encoding="utf-8")
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="eyas train", dynamic_ncols=True)

    def advance(self, steps: int, tokens: int = 0) -> None:
        """Count finished optimizer steps and (global) tokens for the rates; the trainer reads its tokens at log
        steps, so they may come after their steps (the next `rates` counts them)."""
        self._steps_since += steps
        self._tokens_since += tokens
        if self.bar is not None:
            self.bar.update(steps)

    def rates(self) -> dict:
        """Steps/s and tokens/s since the previous call (wall clock)."""
        now = time.perf_counter()
        elapsed = max(now - self._since, 1e-9)
        self.last_rates = {"steps_per_s": self._steps_since / elapsed, "tokens_per_s": self._tokens_since / elapsed}
        self._since, self._steps_since, self._tokens_since = now, 0, 0
        return self.last_rates

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        if self.accelerator.trackers:
            self.accelerator.log({f"{kind}/{k}": v for k, v in metrics.items()}, step=step)
        if not self.main:
            return
        self.jsonl.write(json.dumps({"kind": kind, "step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.bar is not None:
            shown = {k: metrics[k] for k in ("loss", "acc_0", "sim_accept", "lr", "tokens_per_s") if k in metrics}
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)

    def message(self, text: str) -> None:
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.accelerator.trackers:
            self.accelerator.end_training()
        if self.main:
            self.bar.close()
            self.jsonl.close()


def drop_rows_after(path: Path, step: int) -> int:
    """Remove the rows of steps after `step` (a run killed past its last checkpoint redoes them).

    Also drops a torn last line. Returns how many rows were removed; the file is rewritten
    atomically only when something goes.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if int(row.get("step", 0)) > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def logged_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of the train rows a run logged to `logs/metrics.jsonl`."""
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines) if row.get("kind") == "train"}


def first_loss_difference(got: dict[int, float], want: dict[int, float]) -> int | None:
    """The first step whose logged loss differs bitwise between two runs, or that only one of them
    logged; None when every step agrees. It tells a launch that diverged from its first step from a
    resume that went wrong after its checkpoint."""
    return next((step for step in sorted(set(got) | set(want)) if got.get(step) != want.get(step)), None)
