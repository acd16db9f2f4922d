"""Draft directories: what `eyas train` writes and `eyas eval` / `eyas export` read.

  model.safetensors   the head's state_dict (frozen target embedding/lm_head included, so the
                      draft loads without the target); names as each kind's module lists them
  config.json         the `HeadConfig` + `meta` (step, metrics, run ...)
  vocab.safetensors   `d2t` [V_draft] int64 and `t2d` [V] bool (reduced draft vocabulary only)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eyas.draft.config import HeadConfig
from eyas.draft.head import DraftHead
from eyas.draft.registry import head_class
from eyas.errors import EyasError
from eyas.io import atomic_write_json, temp_name

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VOCAB_FILE = "vocab.safetensors"


def _state_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies (safetensors refuses shared or strided storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items() if v is not None}


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = temp_name(path)
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)


def save_draft(directory: str | Path, head: DraftHead, meta: dict | None = None,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a draft directory. `state_dict` overrides the head's own (FSDP/DeepSpeed gather it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _state_tensors(state_dict if state_dict is not None else head.state_dict())
    _save_tensors(tensors, directory / MODEL_FILE, {"format": "pt", "eyas_kind": head.kind})
    atomic_write_json(directory / CONFIG_FILE, {**head.config.to_dict(), "meta": dict(meta or {})}, sort_keys=True)
    if head.d2t is not None:
        _save_tensors({"d2t": tensors["d2t"], "t2d": tensors["t2d"]}, directory / VOCAB_FILE, {})
    return directory


def read_draft_config(directory: str | Path) -> dict:
    """The raw config.json of a draft directory (HeadConfig fields + `meta`)."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise EyasError(f"'{directory}' is not a draft checkpoint (no {CONFIG_FILE}); train one with `eyas train`")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EyasError(f"'{path}' is not valid JSON ({exc}); the checkpoint is damaged") from None


def load_draft(directory: str | Path, device: Any = "cpu", dtype: torch.dtype | None = None
               ) -> tuple[DraftHead, dict]:
    """Rebuild a head from a draft directory -> (head in eval mode, meta).

    `meta` is the saved meta dict plus `target_identity`, `kind` and `aux_layers`.
    """
    directory = Path(directory)
    raw = read_draft_config(directory)
    config = HeadConfig.from_dict(raw, str(directory / CONFIG_FILE))
    if not (directory / MODEL_FILE).is_file():
        raise EyasError(f"'{directory}' has no {MODEL_FILE}; the checkpoint is incomplete")
    state = load_file(str(directory / MODEL_FILE))
    d2t = None
    if config.reduced_vocab:
        if (directory / VOCAB_FILE).is_file():
            d2t = load_file(str(directory / VOCAB_FILE))["d2t"]
        elif "d2t" in state:
            d2t = state["d2t"]
        else:
            raise EyasError(f"'{directory}' uses a draft vocabulary but has no {VOCAB_FILE}; the checkpoint is incomplete")
    head = head_from_config(config, d2t)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise EyasError(f"'{directory}/{MODEL_FILE}' does not match its config: missing {sorted(missing)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    head.to(device=device)
    if dtype is not None:
        head.to(dtype=dtype)  # floating tensors only: d2t/t2d keep int64/bool
    meta = dict(raw.get("meta", {}))
    meta.update(target_identity=config.target_identity, kind=config.kind, aux_layers=config.aux_layers)
    return head.eval(), meta


def head_from_config(cfg: HeadConfig | dict, d2t: torch.Tensor | None = None, where: str = "config.json"
                     ) -> DraftHead:
    """Rebuild a head from a saved config (a HeadConfig, or the dict of a config.json)."""
    if isinstance(cfg, dict):
        cfg = HeadConfig.from_dict(cfg, where)
    return head_class(cfg.kind)(cfg, d2t)
