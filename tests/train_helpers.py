"""Synthetic tensors shaped like a shard batch, and small target configs, for the trainer tests."""

from __future__ import annotations

import torch

from eyas.config import DraftConfig


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
    return DraftConfig(kind=kind, **kw)


def make_workspace(root, target, rows: int = 48) -> dict:
    """Prepare and dump `rows` chitchat conversations on a tiny target (bf16, eagle3 layers + last hidden)."""
    import json

    from eyas.config import load_recipe
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare
    from eyas.data.sources import chitchat_rows

    picked = [r for r in chitchat_rows() if any(m["role"] == "assistant" for m in r["messages"])][:rows]
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in picked) + "\n")
    recipe = load_recipe(None, [
        f"target.path={target}", f"run.output_dir={root}", "dump.draft_vocab_size=128",
        f"data.source={root / 'rows.jsonl'}", "data.max_length=96", "data.heldout_fraction=0.1",
        "dump.shard_tokens=2000", "dump.token_budget=400", "dump.encoding=bf16", "run.name=base"])
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
