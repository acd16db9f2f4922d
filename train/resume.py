"""Resuming a run from its newest checkpoint: checked (the same draft, the settings a resume cannot change,
the random states, the signature) before anything is loaded, then the weights, optimizer, schedule, data
position and RNG of every rank restored, so a resumed run ends with the weights of an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.io import sha256_file
from eyas.train import checkpoint as ckpt
from eyas.train import trust
from eyas.train.optimizer import set_optimizer_settings
from eyas.train.setup import Setup
from eyas.train.state import TrainState

# Settings a resume cannot change: they fix the data order, the batch shapes or the numerics of
# the saved optimizer and data state. Every other train.* setting is applied from the recipe.
# draft_init: the resumed weights are the trained ones, so a changed init could not be applied
FIXED_ON_RESUME = ("source", "token_budget", "ttt_steps", "ttt_token_feed", "mixed_precision", "draft_init")
# Settings that do not change a step's numerics and need no word when they differ.
QUIET_ON_RESUME = ("resume", "trust_checkpoint", "log_every", "logger", "wandb_project", "prefetch", "loader_workers")


def changed_settings(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """train.* settings that differ between a checkpoint's run and this one: {key: (saved, now)}."""
    return {k: (saved[k], v) for k, v in current.items()
            if k in saved and k not in QUIET_ON_RESUME and _as_list(saved[k]) != _as_list(v)}


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def setting_name(key: str) -> str:
    """A changed setting as the recipe names it (train.* keys are kept bare)."""
    return key if "." in key else f"train.{key}"


@dataclass(frozen=True)
class Resumed:
    """What a resume restored beside what it loaded in place (weights, optimizer, schedule, the loader's position)."""

    checkpoint: Path
    state: TrainState
    position: dict                       # the loader's state once restored
    changes: dict[str, tuple[Any, Any]]  # train.* settings applied from this step on: {key: (saved, now)}
    reselect: tuple[str, str] | None     # (the shape that chose best/, this run's) where they differ


def resume(setup: Setup) -> Resumed | None:
    """Restore everything from the newest complete checkpoint, if resuming is on and there is one."""
    latest = setup.resume_from
    if latest is None:
        return None
    saved = ckpt.read_trainer_state(latest)
    position_file = _check_resumable(setup, latest, saved)
    changes = _settings_on_resume(setup, saved, latest)
    position = json.loads(position_file.read_text())
    _check_rng_state(setup, latest)
    # before anything is unpickled; hashing reads the whole state once (seconds per GB of a DeepSpeed state)
    trust.verify_before_load(setup.rank_zero, latest, setup.cfg.trust_checkpoint)
    _load_state(setup, latest / "state")
    setup.scheduler.load_state_dict(saved["scheduler"])
    if changes:
        _apply_changed_settings(setup)
    setup.loader.load_state_dict(position)
    position = setup.loader.state_dict()
    state, reselect = _restored_state(setup, saved)
    return Resumed(latest, state, position, changes, reselect)


def resume_notes(setup: Setup, resumed: Resumed) -> list[str]:
    """What the run's first lines say of its resume beyond the checkpoint and step."""
    notes = [setup.resize.describe()] if setup.resize else []
    if resumed.reselect:
        notes.append(f"best/ was chosen by the simulated acceptance of {resumed.reselect[0]}; the next "
                     f"held-out eval chooses by {resumed.reselect[1]} (train.select_shape)")
    if resumed.changes:
        notes.append("resumed with changed settings, applied from this step on: " + ", ".join(
            f"{setting_name(k)} {old!r} -> {new!r}" for k, (old, new) in resumed.changes.items()))
    return notes


def _check_resumable(setup: Setup, latest: Path, saved: dict) -> Path:
    """Refuses a checkpoint of another draft, or one without its training state; returns this rank's data position file."""
    diffs = setup.head_config.resume_differences(saved["head_config"])
    if diffs:
        raise EyasError(f"cannot resume from '{latest}': the checkpoint's draft differs from this run's ("
                        + "; ".join(diffs) + "); set train.resume=false or use another run.name")
    # every rank stands at the same position at a step boundary; on another number of processes
    # rank 0's is converted (TokenBudgetLoader.load_state_dict)
    position_file = latest / f"loader_rank{0 if setup.processes_changed else setup.accelerator.process_index}.json"
    if not (latest / "state").is_dir() or not position_file.is_file():
        raise EyasError(f"'{latest}' lacks its training state (state/ or {position_file.name}); "
                        "delete it to resume from the one before")
    return position_file


def _restored_state(setup: Setup, saved: dict) -> tuple[TrainState, tuple[str, str] | None]:
    """The saved progress, and (the shape that chose best/, this run's) where another shape chose it."""
    # checkpoints from before train.select_shape chose by the chain figure over the unroll's steps
    best_by = saved.get("best_by", f"chain:{setup.eval_steps}")
    best_score = saved.get("best_score", saved.get("best_sim_accept", -1.0))
    reselect = None
    if best_by != setup.select.spec:  # another figure chose best/: the next held-out eval replaces it
        reselect = (best_by, setup.select.spec)
        best_score = -1.0
    return TrainState(step=saved["step"], tokens=saved["tokens"], best_score=best_score, best_by=best_by,
                      best_step=saved["best_step"], last_eval=saved.get("last_eval", {})), reselect


def _load_state(setup: Setup, state: Path) -> None:
    """accelerate's load_state; on another number of processes a DeepSpeed state is read through a
    universal copy (DeepSpeed refuses to repartition its own format), made once by the main process."""
    acc = setup.accelerator
    if not (setup.processes_changed and getattr(acc.state, "deepspeed_plugin", None)):
        acc.load_state(str(state))
        return
    universal = setup.ckpt_root / f".universal-{state.parent.name}"
    setup.rank_zero.run("conversion of the DeepSpeed state to a universal one",
                        lambda: ckpt.universal_state(state, universal))
    acc.load_state(str(universal))
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(universal, ignore_errors=True)


def _check_rng_state(setup: Setup, latest: Path) -> None:
    """accelerate skips an unreadable RNG state with a log line, and the resume is no longer exact.

    On another number of processes a rank the checkpoint had keeps its state and a new rank has
    none; nothing in a training step draws random numbers (the data order is seeded by the
    recipe), so that changes nothing but the random state a later user of it would see."""
    rank = setup.accelerator.process_index
    rng = latest / "state" / f"random_states_{rank}.pkl"
    position_file = latest / f"loader_rank{rank}.json"
    if setup.processes_changed and not position_file.is_file():
        return
    expected = json.loads(position_file.read_text()).get("rng_sha256")
    if expected is None:  # written before checkpoints recorded it
        return
    if not rng.is_file() or sha256_file(rng) != expected:
        raise EyasError(f"the random state of rank {rank} in '{latest}' is missing or damaged (checksum differs), so "
                        "a resume from it would not be exact; delete that checkpoint to resume from the one before, "
                        "or set train.resume=false")


def _settings_on_resume(setup: Setup, saved: dict, latest: Path) -> dict[str, tuple[Any, Any]]:
    """The changed train.* settings this resume applies; refuses the ones it cannot."""
    if "train" not in saved:  # written before checkpoints recorded their settings
        return {}
    # grad_accum follows the checkpoint's global batch (ckpt.plan_resize), never a "change"
    changes = changed_settings({**saved["train"], "grad_accum": setup.cfg.grad_accum}, dataclasses.asdict(setup.cfg))
    if saved.get("seed", setup.recipe.run.seed) != setup.recipe.run.seed:
        changes["run.seed"] = (saved["seed"], setup.recipe.run.seed)
    fixed = [k for k in changes if k in FIXED_ON_RESUME or k == "run.seed"]
    if fixed:
        what = "; ".join(f"{setting_name(k)} was {changes[k][0]!r}, now {changes[k][1]!r}" for k in fixed)
        raise EyasError(f"cannot resume from '{latest}': {what}. These fix the data order and the saved state; "
                        "set them back to resume, or start over with train.resume=false (or another run.name)")
    return changes


def _apply_changed_settings(setup: Setup) -> None:
    """After load_state restored the saved optimizer: this recipe's lr, schedule, betas and decay."""
    set_optimizer_settings(setup.optimizer, setup.cfg)
    scheduler = setup.scheduler
    scheduler.base_lrs = [setup.cfg.lr for _ in setup.optimizer.param_groups]
    for group, base, factor in zip(setup.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in setup.optimizer.param_groups]
