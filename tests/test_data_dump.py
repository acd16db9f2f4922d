"""Dump stage on a tiny target: exact round trip, 8-bit error bounds, resume, repair, ranks, refusal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.config import load_recipe
from eyas.data import dump as dump_module
from eyas.data.dump import dump
from eyas.data.prepare import load_prepared, prepare
from eyas.data.shards import ShardReader, decode, encode, verify
from eyas.data.vocab import load_vocab
from eyas.errors import EyasError

ROWS = 48


def _rows():
    from eyas.data.sources import chitchat_rows

    rows = [r for r in chitchat_rows() if any(m["role"] == "assistant" for m in r["messages"])]
    return rows[:ROWS]


def _recipe(out: Path, target: Path, source: Path, *extra: str):
    return load_recipe(None, [
        f"target.path={target}", f"data.source={source}", f"run.output_dir={out}", "data.max_length=96",
        "data.heldout_fraction=0.1", "dump.shard_tokens=600", "dump.token_budget=400", "dump.draft_vocab_size=64",
        "dump.layers=[0, 3, 6]", *extra,
    ])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama_dir):
    """A prepared run (48 chitchat conversations) whose prepared/ folder other runs copy."""
    root = tmp_path_factory.mktemp("dump")
    source = root / "rows.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    recipe = _recipe(root, tiny_llama_dir, source)
    prepare(recipe)
    return {"root": root, "source": source, "target": tiny_llama_dir, "prepared": recipe.run_dir / "prepared"}


def _run(workspace, name: str, *extra: str):
    """A recipe for a fresh run named `name` that reuses the workspace's prepared data."""
    recipe = _recipe(workspace["root"], workspace["target"], workspace["source"], f"run.name={name}", *extra)
    if not (recipe.run_dir / "prepared").exists():
        shutil.copytree(workspace["prepared"], recipe.run_dir / "prepared")
    return recipe


def _files(shard_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(shard_dir.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _reference(model, input_ids: torch.Tensor) -> tuple:
    with torch.no_grad():
        return model(input_ids[None], output_hidden_states=True).hidden_states


def test_bf16_round_trip_equals_target_hidden_states(workspace, model):
    # token_budget=1: every sample runs alone, exactly as the reference forward below.
    recipe = _run(workspace, "bf16", "dump.encoding=bf16", "dump.token_budget=1")
    manifest = dump(recipe)
    reader = ShardReader(recipe.run_dir / "shards", expect_identity=manifest["target_identity"])
    train = load_prepared(recipe.run_dir, "train")
    assert len(reader) == len(train) and manifest["layers"] == [0, 3, 6]
    assert sorted(reader.prepared_index(i) for i in range(len(reader))) == list(range(len(train)))
    for i in range(0, len(reader), 5):
        s = reader.sample(i)
        row = train[reader.prepared_index(i)]
        assert s["input_ids"].tolist() == row["input_ids"] and s["loss_mask"].tolist() == row["loss_mask"]
        hs = _reference(model, s["input_ids"])
        expected_aux = torch.cat([hs[0][0], hs[3][0], hs[6][0]], dim=-1).to(torch.bfloat16).float()
        assert torch.equal(s["aux_hidden"], expected_aux)
        assert torch.equal(s["last_hidden"], hs[-1][0].to(torch.bfloat16).float())


def test_batched_dump_matches_single_forward(workspace, model):
    recipe = _run(workspace, "batched", "dump.encoding=fp16", "dump.token_budget=4096")
    dump(recipe)
    reader = ShardReader(recipe.run_dir / "shards")
    for i in range(0, len(reader), 7):
        s = reader.sample(i)
        hs = _reference(model, s["input_ids"])
        # padding rows in a batch change fp32 blocking only: fp16 storage error dominates
        torch.testing.assert_close(s["last_hidden"], hs[-1][0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("encoding,bound", [("int8", lambda x, a: a / 252), ("fp8", lambda x, a: x.abs() / 16 + a / 448 / 512)])
def test_8bit_within_stated_bound(workspace, model, encoding, bound):
    recipe = _run(workspace, encoding, f"dump.encoding={encoding}")
    manifest = dump(recipe)
    reader = ShardReader(recipe.run_dir / "shards")
    worst = 0.0
    for i in range(0, len(reader), 4):
        s = reader.sample(i)
        x = _reference(model, s["input_ids"])[-1][0]
        a = x.abs().amax(dim=-1, keepdim=True)
        err = (s["last_hidden"] - x).abs()
        # the stated bound, plus 1e-5 of the absmax for the batched forward's fp32 rounding
        assert bool((err <= bound(x, a) + 1e-5 * a).all())
        worst = max(worst, float((err / a).max()))
    assert worst > 0  # really quantised
    hidden = manifest["hidden_size"]
    # 8-bit: 4 x hidden bytes of features + 4 bf16 scales + 2-byte id + 1-byte mask per token, plus
    # per-shard headers and per-sample offsets (a few bytes per token with these tiny 600-token shards)
    assert 4 * hidden + 8 + 3 < manifest["bytes_per_token"] < 4 * hidden + 8 + 3 + 4
    assert (recipe.run_dir / "shards" / "heldout" / "manifest.json").is_file()


def test_int4_low_layer_and_topk_teacher(workspace, model):
    recipe = _run(workspace, "compact", "dump.encoding=int8", "dump.low_layer_encoding=int4", "dump.teacher=topk", "dump.topk=8",
                  "dump.token_budget=1")
    manifest = dump(recipe)
    assert set(manifest["features"]) == {"aux_hidden", "topk_values", "topk_ids"}
    assert manifest["features"]["aux_hidden"]["encodings"] == ["int4", "int8", "int8"]
    reader = ShardReader(recipe.run_dir / "shards")
    s = reader.sample(0)
    with torch.no_grad():
        logp = torch.log_softmax(model(s["input_ids"][None]).logits[0].float(), dim=-1)
    top = logp.topk(8, dim=-1)
    assert torch.equal(s["topk_ids"], top.indices)
    torch.testing.assert_close(s["topk_values"], top.values, atol=2e-2, rtol=1e-3)
    x0 = _reference(model, s["input_ids"])[0][0]
    groups = x0.reshape(x0.shape[0], -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(x0.shape)
    assert bool(((s["aux_hidden"][:, :64] - x0).abs() <= groups / 13 + 1e-6).all())


def test_killed_dump_resumes_to_identical_shards(workspace, monkeypatch):
    full = _run(workspace, "uninterrupted")
    dump(full)
    resumed = _run(workspace, "resumed")
    real_write = dump_module.write_shard
    written = []

    def write_then_die(*args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt("simulated kill")
        written.append(real_write(*args, **kwargs))
        return written[-1]

    monkeypatch.setattr(dump_module, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        dump(resumed)
    monkeypatch.undo()
    shard_dir = resumed.run_dir / "shards"
    assert not (shard_dir / "manifest.json").exists() and len(list(shard_dir.glob("shard-*.json"))) == 2
    dump(resumed)
    assert _files(shard_dir) == _files(full.run_dir / "shards")
    a = json.loads((shard_dir / "manifest.json").read_text())
    b = json.loads((full.run_dir / "shards" / "manifest.json").read_text())
    assert a["shards"] == b["shards"] and a["num_samples"] == b["num_samples"] > 0
    assert len(a["shards"]) > 4


@pytest.mark.slow
def test_sigkilled_dump_resumes_to_identical_shards(workspace):
    full = _run(workspace, "uninterrupted")
    if not (full.run_dir / "shards" / "manifest.json").exists():
        dump(full)
    victim = _run(workspace, "sigkilled", "dump.shard_tokens=150")
    recipe_file = workspace["root"] / "sigkilled.yaml"
    recipe_file.write_text(json.dumps(victim.to_dict()))
    shard_dir = victim.run_dir / "shards"
    proc = subprocess.Popen([sys.executable, "-m", "eyas.data.dump", str(recipe_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(shard_dir.glob("shard-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (shard_dir / "manifest.json").exists(), "the dump finished before the kill; the test needs more shards"
    dump(victim)
    reference = _run(workspace, "sigkill-reference", "dump.shard_tokens=150")
    dump(reference)
    assert _files(shard_dir) == _files(reference.run_dir / "shards")
    assert verify(shard_dir) == []


def test_corrupt_and_truncated_shards_are_caught_and_repaired(workspace, capsys):
    recipe = _run(workspace, "uninterrupted")
    if not (recipe.run_dir / "shards" / "manifest.json").exists():
        dump(recipe)
    damaged = _run(workspace, "damaged")
    shutil.copytree(recipe.run_dir / "shards", damaged.run_dir / "shards", dirs_exist_ok=True)
    shard_dir = damaged.run_dir / "shards"
    original = _files(shard_dir)
    flipped = shard_dir / "shard-00001.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0xFF  # same size, different bytes: only the checksum sees it
    flipped.write_bytes(bytes(data))
    assert verify(shard_dir) == [f"{flipped}: checksum mismatch (corrupt)"]
    truncated = shard_dir / "shard-00003.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(EyasError, match="shard-00003.safetensors' is truncated"):
        ShardReader(shard_dir)
    (shard_dir / "shard-00004.safetensors").unlink()
    with pytest.raises(EyasError, match="2 shard file.*shard-00003.safetensors' is truncated.*shard-00004.safetensors' is missing"):
        ShardReader(shard_dir)
    capsys.readouterr()
    dump(damaged)
    out = capsys.readouterr().out
    assert "redoing" in out and "shard-00001" in out and "shard-00003" in out
    assert "shard-00000" not in out  # intact shards are kept
    assert _files(shard_dir) == original and verify(shard_dir) == []


def test_other_target_refused_and_changed_settings_refused(workspace, tiny_qwen2_dir):
    recipe = _run(workspace, "uninterrupted")
    if not (recipe.run_dir / "shards" / "manifest.json").exists():
        dump(recipe)
    from eyas.targets import load_target_config, load_tokenizer, target_identity

    other = target_identity(load_target_config(str(tiny_qwen2_dir)), load_tokenizer(type(recipe.target)(path=str(tiny_qwen2_dir))))
    with pytest.raises(EyasError, match="another target or tokenizer"):
        ShardReader(recipe.run_dir / "shards", expect_identity=other)
    changed = _run(workspace, "uninterrupted", "dump.encoding=int8")
    with pytest.raises(EyasError, match="changed: encoding"):
        dump(changed)


def test_draft_vocab_from_masked_frequencies(workspace):
    recipe = _run(workspace, "uninterrupted")
    if not (recipe.run_dir / "shards" / "manifest.json").exists():
        dump(recipe)
    d2t, t2d = load_vocab(recipe.run_dir / "shards")
    from safetensors.torch import load_file

    counts = load_file(str(recipe.run_dir / "shards" / "vocab.safetensors"))["counts"]
    expected = torch.zeros_like(counts)
    for row in load_prepared(recipe.run_dir, "train"):
        for token, m in zip(row["input_ids"], row["loss_mask"]):
            expected[token] += m
    assert torch.equal(counts, expected)
    assert d2t.numel() == 64 and int(t2d.sum()) == 64
    target_ids = torch.arange(64) + d2t
    assert torch.equal(target_ids, torch.nonzero(t2d).flatten())  # SGLang: target = draft + d2t[draft]
    threshold = counts[t2d].min()
    assert bool((counts[~t2d] <= threshold).all())  # nothing left out is more frequent than what was kept


def test_ranks_write_disjoint_parts(workspace):
    """Two ranks run one after the other (as a SLURM array would), then a single-process finalize."""
    single = _run(workspace, "uninterrupted")
    if not (single.run_dir / "shards" / "manifest.json").exists():
        dump(single)
    split = _run(workspace, "two-ranks")
    env = dict(os.environ)
    try:
        for rank in (0, 1):
            os.environ.update(RANK=str(rank), WORLD_SIZE="2")
            assert dump(split) is None  # rank 0 finds rank 1's part missing; rank 1 never writes the manifest
            names = {p.name for p in (split.run_dir / "shards").glob("shard-*.safetensors")}
            if rank == 0:
                assert names and all(int(n[6:11]) % 2 == 0 for n in names)
    finally:
        os.environ.clear()
        os.environ.update(env)
    manifest = dump(split)
    assert _files(split.run_dir / "shards") == _files(single.run_dir / "shards")
    assert manifest["num_samples"] == json.loads((single.run_dir / "shards" / "manifest.json").read_text())["num_samples"]


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(workspace):
    single = _run(workspace, "uninterrupted")
    if not (single.run_dir / "shards" / "manifest.json").exists():
        dump(single)
    two = _run(workspace, "torchrun")
    recipe_file = workspace["root"] / "torchrun.yaml"
    recipe_file.write_text(json.dumps(two.to_dict()))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         "-m", "eyas.data.dump", str(recipe_file)], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    a = ShardReader(two.run_dir / "shards")
    b = ShardReader(single.run_dir / "shards")
    assert sorted(a.prepared_index(i) for i in range(len(a))) == sorted(b.prepared_index(i) for i in range(len(b)))
    assert _files(two.run_dir / "shards") == _files(single.run_dir / "shards")


def test_encode_decode_bounds_random():
    torch.manual_seed(0)
    x = torch.randn(500, 128) * torch.rand(500, 1) * 50
    a = x.abs().amax(-1, keepdim=True)
    for encoding, bound in (("int8", a / 252), ("fp8", x.abs() / 16 + a / 448 / 512)):
        parts = encode(x, encoding)
        assert parts[""].element_size() == 1
        assert bool(((decode(parts[""], parts[".scale"], encoding) - x).abs() <= bound).all())
    parts = encode(x, "bf16")
    assert torch.equal(decode(parts[""], None, "bf16"), x.to(torch.bfloat16).float())
