"""Synthetic tensors shaped like a shard batch, and small target configs, for the trainer tests; a pause
that holds launched trainers at a step until their stop signal arrives."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eyas.recipe_kinds import draft_config
from eyas.recipe_schema import DraftConfig


def tiny_target_config(family: str = "llama", **overrides):
    from transformers import LlamaConfig, Qwen2Config

    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    base.update(overrides)
    return (LlamaConfig if family == "llama" else Qwen2Config)(**base)


def tiny_d2t(vocab: int = 384, draft_vocab: int = 200) -> torch.Tensor:
    """A draft vocabulary of all even ids, then the smallest odd ids, sorted (SGLang convention:
    target = draft + d2t[draft]); a non-trivial map, so mapping mistakes show."""
    order = list(range(0, vocab, 2)) + list(range(1, vocab, 2))
    target_ids = torch.tensor(sorted(order[:draft_vocab]))
    return target_ids - torch.arange(draft_vocab)


def synthetic_batch(hidden: int = 64, vocab: int = 384, batch: int = 2, seq: int = 16, seed: int = 0,
                    pad_last: int = 3) -> dict:
    """A right-padded batch with the shard reader's keys; the second row is `pad_last` shorter."""
    g = torch.Generator().manual_seed(seed)
    attention = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1 and pad_last:
        attention[1, seq - pad_last:] = 0
    loss_mask = attention.float().clone()
    loss_mask[:, :3] = 0  # a "prompt" that is not trained on
    return {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=g) * attention,
        "loss_mask": loss_mask,
        "attention_mask": attention,
        "aux_hidden": torch.randn(batch, seq, 3 * hidden, generator=g) * attention[..., None],
        "last_hidden": torch.randn(batch, seq, hidden, generator=g) * attention[..., None],
    }


def draft_cfg(kind: str, **kw) -> DraftConfig:
    return draft_config(kind=kind, **kw)


def make_workspace(root, target, rows: int = 48, *overrides: str) -> dict:
    """Prepare and dump `rows` chitchat conversations on a tiny target (bf16, eagle3 layers + last hidden);
    `overrides` replace the recipe's keys below."""
    from fixtures import write_chat_rows

    from eyas.config import load_recipe
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare

    write_chat_rows(root / "rows.jsonl", rows)
    recipe = load_recipe(None, [
        f"target.path={target}", f"run.output_dir={root}", "dump.draft_vocab_size=128",
        f"data.source={root / 'rows.jsonl'}", "data.max_length=96", "data.heldout_fraction=0.1",
        "dump.shard_tokens=2000", "dump.token_budget=400", "dump.encoding=bf16", "run.name=base", *overrides])
    prepare(recipe)
    dump(recipe)
    return {"root": root, "target": target}


def new_run(ws: dict, name: str):
    """A fresh run directory sharing the workspace's shards and prepared data (symlinks)."""
    import shutil

    run = ws["root"] / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    for part in ("shards", "prepared"):
        (run / part).symlink_to(ws["root"] / "base" / part)
    return run


# A sitecustomize (Python imports it at start-up from PYTHONPATH) that patches the trainer once
# eyas.train.loop is imported, so the launched command stays the real one. Processes that never
# import the trainer (launchers, other stages) are untouched.
_PAUSE_SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys, time
from pathlib import Path


def _pause(loop):
    at, folder = int(os.environ["EYAS_TEST_PAUSE_AT_STEP"]), Path(os.environ["EYAS_TEST_PAUSE_DIR"])
    stop_requested = loop.Trainer._stop_requested

    def paused(self, signals, stop_at_step):
        if self.state.step == at:  # step `at` is done and logged; a resumed run starts past it
            (folder / f"rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 600
            while signals.received is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return stop_requested(self, signals, stop_at_step)

    loop.Trainer._stop_requested = paused


class _PatchTheTrainer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "eyas.train.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _pause(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("EYAS_TEST_PAUSE_DIR"):
    sys.meta_path.insert(0, _PatchTheTrainer())
"""


def pause_training_at(step: int, folder: Path, env: dict) -> dict:
    """`env` plus what makes every trainer launched with it wait after optimizer step `step` until its
    SIGTERM or SIGUSR1 has arrived (at most 10 minutes), each rank first writing `folder/rank<RANK>`.

    A test that signals once such a file exists stops the run at exactly `step`, however slow the
    machine: no training can end before the signal, and none is signalled before it started."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_PAUSE_SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")]))
    return {**env, "PYTHONPATH": path, "EYAS_TEST_PAUSE_DIR": str(folder), "EYAS_TEST_PAUSE_AT_STEP": str(step)}
