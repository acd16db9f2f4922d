"""Every stage on mixture-of-experts targets: a tiny Qwen3-MoE (4 experts, 2 routed per token, in all six
layers) and a tiny gpt-oss (the same, plus sliding-window layers of 8 tokens alternating with full ones and
attention sinks), saved and loaded through transformers' `from_pretrained` like a user's model folder.

prepare and dump store the target's own hidden states (the residual stream between decoder layers: an MoE
layer's output like a dense one's; router logits are not features), eagle3, mtp and dflash heads train on them,
the exact decoder's outputs equal the target's greedy decode at T=0 (past gpt-oss's window), and the
exports load back as the engines see them. vLLM serving the Qwen3-MoE draft: tests/test_vllm_parity.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import build_tiny_target
from train_helpers import make_workspace, new_run

from eyas.config import load_recipe
from eyas.data.shard_reader import ShardReader
from eyas.data.shard_verify import verify
from eyas.draft.features import default_layers
from eyas.eval.cli import main as eval_main
from eyas.train.checkpoint import best_checkpoint
from eyas.train.export import export_draft, load_exported
from eyas.train.loop import train


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def target_dir(request, tiny_qwen3_moe_dir, tmp_path_factory):
    if request.param == "qwen3_moe":
        return tiny_qwen3_moe_dir
    return build_tiny_target(tmp_path_factory.mktemp("tiny_gpt_oss"), "gpt_oss")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, target_dir):
    return make_workspace(tmp_path_factory.mktemp("moe"), target_dir)


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def test_the_dump_holds_the_moe_targets_hidden_states(workspace, target):
    shard_dir = workspace["root"] / "base" / "shards"
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["layers"] == default_layers(6) == [1, 3, 5]  # distinct: engines capture each layer once
    assert set(manifest["features"]) == {"aux_hidden", "last_hidden"} and verify(shard_dir) == []
    reader = ShardReader(shard_dir)
    sample = reader.sample(len(reader) - 1)
    with torch.no_grad():
        hidden = target(sample["input_ids"][None], output_hidden_states=True).hidden_states
    width = target.config.hidden_size
    for j, layer in enumerate(manifest["layers"]):
        stored, exact = sample["aux_hidden"][:, j * width:(j + 1) * width], hidden[layer][0]
        # bf16 shards: half a bf16 step of each value, plus the batched forward's fp32 noise
        assert bool(((stored - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-4).all()), layer
    assert bool(((sample["last_hidden"] - hidden[-1][0]).abs() <= hidden[-1][0].abs() * 2.0 ** -8 + 1e-4).all())


def _recipe(workspace, name: str, *extra: str):
    new_run(workspace, name)
    return load_recipe(None, [
        f"target.path={workspace['target']}", f"run.output_dir={workspace['root']}", f"run.name={name}",
        "dump.draft_vocab_size=128", "train.token_budget=400", "train.max_steps=16", "train.ttt_steps=3",
        "train.save_every=0", "train.eval_every=0", "train.log_every=1", "train.warmup_steps=2", "train.lr=3e-3",
        "train.mixed_precision=fp32", *extra])


def _losses(run_dir) -> list[float]:
    rows = map(json.loads, (run_dir / "logs" / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("kind, extra", [("eagle3", ()), ("mtp", ("draft.kind=mtp", "draft.num_steps=3")),
                                         ("dflash", ("draft.kind=dflash", "draft.num_steps=3"))])
def test_a_draft_trains_on_the_moe_target_and_decodes_it_exactly(workspace, tmp_path, capsys, kind, extra):
    recipe = _recipe(workspace, f"moe_{kind}", *extra)
    train(recipe)
    losses = _losses(recipe.run_dir)
    assert len(losses) == 16 and sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    checkpoint = best_checkpoint(recipe.run_dir)
    out = tmp_path / "eval"
    code = eval_main(["--target", str(workspace["target"]), "--draft", str(checkpoint), "--prompts",
                      str(workspace["root"] / "rows.jsonl"), "--max-prompts", "8", "--max-new-tokens", "16",
                      "eval.target_dtype=fp32", "--shapes", "chain:3", "dynamic:depth=3,topk=2,nodes=6",
                      "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert len(report["configs"]) == 2
    for config in report["configs"]:  # T=0: every speculative output is the target's greedy one
        match = config["overall"]["greedy_match"]
        assert match["matched"] == match["compared"] == report["settings"]["prompts_used"] >= 3, config["label"]


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_the_eagle3_export_of_an_moe_draft_loads_back_as_trained(workspace, target, tmp_path, fmt):
    recipe = _recipe(workspace, f"moe_export_{fmt}", "train.max_steps=4")
    train(recipe)
    checkpoint = best_checkpoint(recipe.run_dir)
    from eyas.draft.checkpoint import load_draft

    head, _ = load_draft(checkpoint)
    out = export_draft(checkpoint, fmt, tmp_path / fmt, dtype="float32", target_path=str(workspace["target"]))
    back = load_exported(out, target.get_input_embeddings().weight.detach())
    assert back.config.aux_layers == head.config.aux_layers == [1, 3, 5]
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(0))
    feature = torch.randn(1, 9, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, want = head.step(0, ids, head.project(feature), torch.arange(9))
        _, got = back.step(0, ids, back.project(feature), torch.arange(9))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
