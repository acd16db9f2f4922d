"""Training checkpoints: a draft directory plus the full training state, for an exact resume.

A training checkpoint `run_dir/checkpoints/step_NNNNNNNN/` is a draft directory
(`eyas.draft.checkpoint`: model.safetensors, config.json, vocab.safetensors) plus
  state/              accelerate's `save_state`: model, optimizer, RNG of every rank
  trainer.json        step, epoch, scheduler state, best metric, tokens seen, head config
  loader_rank{r}.json the data position of rank r
Directories are written under a `.partial` name and swapped into place when complete
(`eyas.io.publish_dir`), so a checkpoint that exists is whole. `checkpoints/best/` is a draft
directory (the best held-out simulated acceptance so far), replaced atomically.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eyas.draft.checkpoint import CONFIG_FILE
from eyas.errors import EyasError
from eyas.io import atomic_write_json

TRAINER_FILE = "trainer.json"
STEP_PREFIX = "step_"

# ---- training checkpoints -------------------------------------------------------------------


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(checkpoints: str | Path) -> list[Path]:
    """Complete step checkpoints, oldest first."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir()
             if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()
             and (p / TRAINER_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(checkpoints: str | Path) -> Path | None:
    found = list_checkpoints(checkpoints)
    return found[-1] if found else None


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The run's best draft (by held-out simulated acceptance), else its newest; None if none."""
    checkpoints = Path(run_dir) / "checkpoints"
    if (checkpoints / "best" / CONFIG_FILE).is_file():
        return checkpoints / "best"
    return latest_checkpoint(checkpoints)


def prune_checkpoints(checkpoints: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step checkpoints (the best lives in `best/`)."""
    found = list_checkpoints(checkpoints)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    for stale in checkpoints.glob("*.partial"):  # leftovers of a run killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    return doomed


def write_json(path: Path, data: dict) -> None:
    atomic_write_json(path, data, sort_keys=True)


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / TRAINER_FILE
    if not path.is_file():
        raise EyasError(f"'{directory}' is not a training checkpoint (no {TRAINER_FILE})")
    return json.loads(path.read_text())
