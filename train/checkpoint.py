"""Draft checkpoints (weights + config + vocab maps) and the full training state.

A draft directory (what `eyas eval` and `eyas export` read; written by `save_draft`):
  model.safetensors   the head's state_dict (frozen target embedding/lm_head included, so the
                      draft loads without the target), keys as listed in `eyas.train.heads`
  config.json         the head config (`heads.head_config`) + `meta` (step, metrics, run ...)
  vocab.safetensors   `d2t` [V_draft] int64 and `t2d` [V] bool (eagle3 with a draft vocab only)

A training checkpoint `run_dir/checkpoints/step_NNNNNNNN/` is a draft directory plus
  state/              accelerate's `save_state`: model, optimizer, RNG of every rank
  trainer.json        step, epoch, scheduler state, best metric, tokens seen, recipe fingerprint
  loader_rank{r}.json the data position of rank r
Directories are written under a `.partial` name and renamed when complete, so a checkpoint
that exists is whole. `checkpoints/best/` is a draft directory (the best held-out simulated
acceptance so far), replaced atomically.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eyas.errors import EyasError
from eyas.train.heads import DraftHead, build_head_from_config

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VOCAB_FILE = "vocab.safetensors"
TRAINER_FILE = "trainer.json"
STEP_PREFIX = "step_"


def _state_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies (safetensors refuses shared or strided storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items() if v is not None}


def save_draft(directory: str | Path, head: DraftHead, meta: dict | None = None,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a draft directory. `state_dict` overrides the head's own (FSDP/DeepSpeed gather it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _state_tensors(state_dict if state_dict is not None else head.state_dict())
    save_file(tensors, str(directory / MODEL_FILE), metadata={"format": "pt", "eyas_kind": head.kind})
    config = dict(head.config)
    config["meta"] = dict(meta or {})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    if head.d2t is not None:
        save_file({"d2t": tensors["d2t"], "t2d": tensors["t2d"]}, str(directory / VOCAB_FILE))
    return directory


def read_draft_config(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise EyasError(f"'{directory}' is not a draft checkpoint (no {CONFIG_FILE}); train one with `eyas train`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EyasError(f"'{path}' is not valid JSON ({exc.msg}); the checkpoint is damaged") from None


def load_draft(directory: str | Path, device: Any = "cpu", dtype: torch.dtype | None = None
               ) -> tuple[DraftHead, dict]:
    """Rebuild a head from a draft directory -> (head in eval mode, meta).

    `meta` is the saved meta dict plus `target_identity`, `kind` and `aux_layers`.
    """
    directory = Path(directory)
    config = read_draft_config(directory)
    if not (directory / MODEL_FILE).is_file():
        raise EyasError(f"'{directory}' has no {MODEL_FILE}; the checkpoint is incomplete")
    state = load_file(str(directory / MODEL_FILE))
    d2t = None
    if config["draft_vocab_size"] != config["vocab_size"]:
        if (directory / VOCAB_FILE).is_file():
            d2t = load_file(str(directory / VOCAB_FILE))["d2t"]
        elif "d2t" in state:
            d2t = state["d2t"]
        else:
            raise EyasError(f"'{directory}' uses a draft vocabulary but has no {VOCAB_FILE}; the checkpoint is incomplete")
    head = build_head_from_config({k: v for k, v in config.items() if k != "meta"}, d2t)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise EyasError(f"'{directory}/{MODEL_FILE}' does not match its config: missing {sorted(missing)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    head.to(device=device)
    if dtype is not None:
        head.to(dtype=dtype)  # floating tensors only: d2t/t2d keep int64/bool
    meta = dict(config.get("meta", {}))
    meta.update(target_identity=config.get("target_identity", ""), kind=config["kind"], aux_layers=config["aux_layers"])
    return head.eval(), meta


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


def publish(partial: Path, final: Path) -> Path:
    """Atomically move a completed `.partial` directory into place (replacing an older one)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(final)
    return final


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    tmp.replace(path)


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / TRAINER_FILE
    if not path.is_file():
        raise EyasError(f"'{directory}' is not a training checkpoint (no {TRAINER_FILE})")
    return json.loads(path.read_text())


# Head config fields that must agree for a resume (or a warm start) to make sense.
_RESUME_FIELDS = ("kind", "num_layers", "mtp_feed", "aux_layers", "hidden_size", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                  "target_identity")


def compatibility_errors(saved: dict, current: dict) -> list[str]:
    """What differs between a saved head config and the one this run builds (empty: compatible)."""
    diffs = []
    for key in _RESUME_FIELDS:
        if saved.get(key) != current.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)!r} vs this run {current.get(key)!r}")
    return diffs
