"""End to end on the real target: `eyas prepare` + `eyas dump` over chitchat conversations with SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.cli.main import main as eyas_main
from eyas.data.prepare import load_prepared
from eyas.data.shard_reader import ShardReader
from eyas.data.shard_verify import verify
from eyas.data.vocab import load_vocab
from eyas.train.loader import TokenBudgetLoader


@pytest.mark.slow
def test_prepare_and_dump_chitchat_on_smollm2(tmp_path, smollm2_dir, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"run:\n  output_dir: {tmp_path}/runs\n  name: e2e\n"
        "data:\n  source: chitchat\n  max_samples: 24\n  max_length: 256\n  heldout_fraction: 0.1\n"
        "dump:\n  encoding: int8\n  token_budget: 2048\n  shard_tokens: 3000\n  draft_vocab_size: 2048\n"
    )
    assert eyas_main(["prepare", str(recipe)]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "e2e"
    skipped = json.loads((run_dir / "prepared" / "skipped.json").read_text())
    train, heldout = load_prepared(run_dir, "train"), load_prepared(run_dir, "heldout")
    assert len(train) + len(heldout) + skipped["total"] == 24
    assert skipped["counts"].get("no assistant turn", 0) > 0 and "no assistant turn" in out

    assert eyas_main(["dump", str(recipe)]) == 0
    shard_dir = run_dir / "shards"
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["num_samples"] == len(train) and manifest["hidden_size"] == 576
    assert manifest["layers"] == [2, 15, 27] and set(manifest["features"]) == {"aux_hidden", "last_hidden"}
    assert manifest["num_tokens"] == sum(len(x) for x in train["input_ids"])
    assert manifest["ratio_to_anchor_layout"] < 0.51
    assert verify(shard_dir) == []

    from eyas.recipe_schema import TargetConfig
    from eyas.targets import SMOLLM2_ALIAS, load_target_config, load_tokenizer, target_identity

    identity = target_identity(load_target_config(SMOLLM2_ALIAS), load_tokenizer(TargetConfig()))
    reader = ShardReader(shard_dir, expect_identity=identity)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    s = reader.sample(len(reader) - 1)  # the shortest sample
    with torch.no_grad():
        hs = model(s["input_ids"][None], output_hidden_states=True).hidden_states
    for j, layer in enumerate([2, 15, 27]):
        x = hs[layer][0]
        bound = x.abs().amax(-1, keepdim=True) / 252 + 1e-3  # int8 bound + batched-forward fp32 noise
        assert bool(((s["aux_hidden"][:, j * 576:(j + 1) * 576] - x).abs() <= bound).all())
    batch = next(iter(TokenBudgetLoader(reader, token_budget=1024, seed=0)))
    assert batch["aux_hidden"].shape[-1] == 3 * 576 and batch["input_ids"].numel() <= 1024
    d2t, t2d = load_vocab(shard_dir)
    assert d2t.numel() == 2048 and t2d.numel() == 49152
