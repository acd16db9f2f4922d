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
from dataclasses import dataclass
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
    for stale in [*checkpoints.glob("*.partial"), *checkpoints.glob(".universal-*")]:  # left by a run killed while
        shutil.rmtree(stale, ignore_errors=True)                                         # saving or resuming
    return doomed


def write_json(path: Path, data: dict) -> None:
    atomic_write_json(path, data, sort_keys=True)


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / TRAINER_FILE
    if not path.is_file():
        raise EyasError(f"'{directory}' is not a training checkpoint (no {TRAINER_FILE})")
    return json.loads(path.read_text())


# ---- resuming on another number of processes -------------------------------------------------


@dataclass(frozen=True)
class Resize:
    """A resume whose recipe splits the checkpoint's global batch (processes x micro-batches per step,
    each of `train.token_budget` tokens) differently: another number of processes, or a recipe
    `train.grad_accum` that is not the checkpoint's. The global batch is kept; grad_accum is recomputed."""

    checkpoint: Path
    saved_world: int
    saved_accum: int
    world: int
    recipe_accum: int
    accum: int

    @property
    def processes_changed(self) -> bool:
        return self.world != self.saved_world

    def describe(self) -> str:
        accum = f"{self.recipe_accum} -> {self.accum}" if self.recipe_accum != self.accum else str(self.accum)
        return (f"resuming {self.saved_world} -> {self.world} process(es): train.grad_accum {accum} keeps the "
                f"checkpoint's global batch of {self.saved_world * self.saved_accum} micro-batches "
                "per step (to change it, start over with train.resume=false)")


def plan_resize(checkpoint: Path | None, world: int, accum: int) -> Resize | None:
    """How a resume from `checkpoint` splits its global batch over `world` processes; None when nothing
    changes (the checkpoint's process count and grad_accum). Refused when `world` does not divide it."""
    if checkpoint is None:
        return None
    saved = read_trainer_state(checkpoint)
    saved_world = int(saved["world_size"])
    saved_accum = int(saved.get("train", {}).get("grad_accum", accum))
    group = saved_world * saved_accum
    if world == saved_world and accum == saved_accum:
        return None
    if group % world:
        raise EyasError(f"cannot resume from '{checkpoint}' on {world} process(es): its global batch of {saved_world} "
                        f"process(es) x {saved_accum} micro-batches does not split evenly over {world}; resume on a "
                        f"number of processes that divides {group} (set train.grad_accum so that processes x "
                        "grad_accum is a multiple of every process count a run may get), or set train.resume=false")
    return Resize(checkpoint, saved_world, saved_accum, world, accum, group // world)


def universal_state(state: Path, out: Path) -> Path:
    """A copy of accelerate's DeepSpeed `state/` folder whose ZeRO checkpoint is in DeepSpeed's universal
    format, which DeepSpeed loads on any number of processes (`checkpoint.load_universal`); the
    checkpoint itself is left as it is. The other files (random states) are linked in."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for item in state.iterdir():
        if item.is_dir() and any(item.glob("*optim_states.pt")):  # a DeepSpeed tag folder (accelerate's "pytorch_model")
            ds_to_universal(Namespace(input_folder=str(item), output_folder=str(out / item.name), num_extract_workers=1,
                                      num_merge_workers=1, keep_temp_folder=False, strict=True,
                                      inject_missing_state=True))
        elif item.is_file():
            (out / item.name).symlink_to(item.resolve())
    return out
