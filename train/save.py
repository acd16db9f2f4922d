"""Saving a run's checkpoints (the layout is `eyas.train.checkpoint`'s): a step checkpoint, in which every rank
writes its training state and the main process the draft, trainer.json, the signature and the swap into place
(pruning to `train.keep_last`); or only the draft, into `best/`."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eyas.draft.checkpoint import save_draft
from eyas.errors import EyasError
from eyas.io import fresh_partial, publish_dir, sha256_file
from eyas.train import checkpoint as ckpt
from eyas.train import trust
from eyas.train.accelerator import saved_weights
from eyas.train.setup import Setup
from eyas.train.state import TrainState
from eyas.train.ttt import head_state


def save_checkpoint(setup: Setup, state: TrainState, position: dict, best_only: bool = False, *,
                    write_draft: Callable[..., Any] = save_draft, publish: Callable[[Path, Path], Any] = publish_dir) -> Path:
    """Save a step checkpoint (every rank takes part), or only the draft into `best/`. `position`: the data
    position after the last step. `write_draft`, `publish`: what writes the draft's files and what swaps the
    finished directory into place (a caller may stand in a full disk or a slow filesystem).

    A failed write (a full disk) removes the half-written directory and stops with the fix;
    the checkpoints already published are untouched.
    """
    root = setup.ckpt_root
    name = "best" if best_only else ckpt.step_dir(root, state.step).name
    partial = root / f"{name}.partial"
    try:
        return _write(setup, state, position, best_only, partial, root / name, write_draft, publish)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        last = ckpt.latest_checkpoint(root)
        raise EyasError(f"cannot write the checkpoint '{root / name}': {exc.strerror or exc}. "
                        f"Nothing saved before is lost (newest complete checkpoint: {last or 'none'}); free disk "
                        "space and run the same command again to resume") from None


def _write(setup: Setup, state: TrainState, position: dict, best_only: bool, partial: Path, final: Path,
           write_draft: Callable[..., Any], publish: Callable[[Path, Path], Any]) -> Path:
    acc = setup.accelerator
    setup.rank_zero.run("checkpoint's fresh directory", lambda: fresh_partial(final))
    state_dict = head_state(saved_weights(acc, setup.model, setup.frozen_fp32))
    meta = draft_meta(setup, state, best_only)
    if not best_only:
        acc.save_state(str(partial / "state"))
        rng = partial / "state" / f"random_states_{acc.process_index}.pkl"
        ckpt.write_json(partial / f"loader_rank{acc.process_index}.json",
                        {**position, "rng_sha256": sha256_file(rng) if rng.is_file() else None})

    def write_main_files() -> None:
        write_draft(partial, setup.head, meta, state_dict)
        if not best_only:
            ckpt.write_json(partial / ckpt.TRAINER_FILE, trainer_file(setup, state))

    def sign_and_publish() -> None:
        if not best_only:  # sign what a resume reads (eyas.train.trust)
            trust.sign_checkpoint(partial)
        publish(partial, final)
        if not best_only:
            ckpt.prune_checkpoints(setup.ckpt_root, setup.cfg.keep_last)

    setup.rank_zero.run("draft's save", write_main_files)
    acc.wait_for_everyone()  # every rank's files are written before they are signed
    setup.rank_zero.run("checkpoint's signing and publishing", sign_and_publish)
    return final


def draft_meta(setup: Setup, state: TrainState, best_only: bool) -> dict:
    """What the saved draft's config records of its run; `best/`'s also what chose it."""
    meta = {"step": state.step, "eval": state.last_eval, "run": setup.recipe.run.name,
            "tokens": state.tokens, "train_steps": setup.train_steps, "ttt_steps": setup.cfg.ttt_steps}
    if best_only:  # what chose it
        meta["selected_by"] = {"shape": state.best_by, "simulated_acceptance": state.best_score,
                               "on": state.last_eval.get("split")}
    return meta


def trainer_file(setup: Setup, state: TrainState) -> dict:
    """trainer.json: the state, the schedule's position and the settings a resume checks against its own."""
    return {**state.to_dict(), "scheduler": setup.scheduler.state_dict(),
            "world_size": setup.accelerator.num_processes, "head_config": setup.head_config.to_dict(),
            "train": dataclasses.asdict(setup.cfg), "seed": setup.recipe.run.seed, "total_steps": setup.total_steps}
