"""Dump stage on a tiny target: exact round trip, 8-bit error bounds, resume, repair, ranks, refusal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
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
from eyas.data.shard_format import decode, encode
from eyas.data.shard_reader import ShardReader
from eyas.data.shard_verify import verify
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
    real_finish = dump_module.ShardWriter.finish
    written = []

    def finish_then_die(writer):
        if len(written) == 2:
            writer.abort()
            raise KeyboardInterrupt("simulated kill")
        written.append(real_finish(writer))
        return written[-1]

    monkeypatch.setattr(dump_module.ShardWriter, "finish", finish_then_die)
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


# `eyas dump RECIPE` in a fresh process that, once its first shard is finished (in place, sidecar
# written), writes the file argv[2] and holds the dump there (shard 1 is written meanwhile, not
# finished), so a SIGKILL sent when the file appears always lands mid-dump. Never killed: exit 3.
_DUMP_HELD_AFTER_ITS_FIRST_SHARD = """
import os, sys, time
from pathlib import Path
from eyas.data import dump as dump_module

finish = dump_module.ShardWriter.finish

def finish_then_hold(writer):
    record = finish(writer)
    Path(sys.argv[2]).write_text(str(os.getpid()))
    time.sleep(600)
    os._exit(3)

dump_module.ShardWriter.finish = finish_then_hold
sys.exit(dump_module.main([sys.argv[1]]))
"""


@pytest.mark.slow
@pytest.mark.cluster
def test_sigkilled_dump_resumes_to_identical_shards(workspace):
    full = _run(workspace, "uninterrupted")
    if not (full.run_dir / "shards" / "manifest.json").exists():
        dump(full)
    victim = _run(workspace, "sigkilled", "dump.shard_tokens=150")
    recipe_file = workspace["root"] / "sigkilled.yaml"
    recipe_file.write_text(json.dumps(victim.to_dict()))
    shard_dir = victim.run_dir / "shards"
    first_shard, log = workspace["root"] / "sigkilled-first-shard", workspace["root"] / "sigkilled.log"
    first_shard.unlink(missing_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _DUMP_HELD_AFTER_ITS_FIRST_SHARD, str(recipe_file), str(first_shard)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not first_shard.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_shard.exists(), f"no shard finished (exit status {proc.poll()}): {log.read_text()[-2000:]}"
    finally:
        proc.send_signal(signal.SIGKILL)  # the dump is held after shard 0: the kill lands mid-dump
        proc.wait()
    assert (shard_dir / "shard-00000.json").exists() and not (shard_dir / "manifest.json").exists()
    dump(victim)
    reference = _run(workspace, "sigkill-reference", "dump.shard_tokens=150")
    dump(reference)
    assert _files(shard_dir) == _files(reference.run_dir / "shards")
    assert verify(shard_dir) == []


def _copy_with_a_flipped_byte(workspace, name: str):
    """Run `name` holding a copy of the uninterrupted dump with one byte of shard 1 flipped (same size,
    different bytes: only a checksum sees it) -> (recipe, shard dir, the intact files, the flipped file)."""
    recipe = _run(workspace, "uninterrupted")
    if not (recipe.run_dir / "shards" / "manifest.json").exists():
        dump(recipe)
    copy = _run(workspace, name)
    shutil.copytree(recipe.run_dir / "shards", copy.run_dir / "shards", dirs_exist_ok=True)
    shard_dir = copy.run_dir / "shards"
    original = _files(shard_dir)
    flipped = shard_dir / "shard-00001.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    return copy, shard_dir, original, flipped


def test_corrupt_and_truncated_shards_are_caught_and_repaired(workspace, capsys):
    damaged, shard_dir, original, flipped = _copy_with_a_flipped_byte(workspace, "damaged")
    assert verify(shard_dir) == [f"{flipped}: checksum mismatch (corrupt)"]
    truncated = shard_dir / "shard-00003.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(EyasError, match="shard-00003.safetensors' is truncated"):
        ShardReader(shard_dir)
    (shard_dir / "shard-00004.safetensors").unlink()
    with pytest.raises(EyasError, match="2 shard file.*shard-00003.safetensors' is truncated.*shard-00004.safetensors' is missing"):
        ShardReader(shard_dir)
    capsys.readouterr()
    dump(damaged, reverify=True)  # a same-size flip is seen only by hashing: a plain rerun trusts finished shards
    out = capsys.readouterr().out
    assert "redoing" in out and "shard-00001" in out and "shard-00003" in out
    assert "shard-00000" not in out  # intact shards are kept
    assert _files(shard_dir) == original and verify(shard_dir) == []


def test_rerun_trusts_finished_shards_and_reverify_rehashes(workspace, capsys, monkeypatch):
    """A rerun hashes no finished shard (sidecar, size and header only); the reader still stops at the
    corrupt sample; `eyas dump --reverify` hashes them all and redoes the corrupt one."""
    from eyas.cli.main import main
    from eyas.data import shard_writer

    trusting, shard_dir, original, flipped = _copy_with_a_flipped_byte(workspace, "trusting")
    hashed = []
    real_sha256 = shard_writer.sha256_file
    monkeypatch.setattr(shard_writer, "sha256_file", lambda path: hashed.append(Path(path).name) or real_sha256(path))
    capsys.readouterr()
    dump(trusting)
    assert "redoing" not in capsys.readouterr().out and hashed == []
    assert _files(shard_dir)["shard-00001.safetensors"] != original["shard-00001.safetensors"]
    reader = ShardReader(shard_dir)
    with pytest.raises(EyasError, match="shard-00001.safetensors' is corrupt: sample .* does not match its checksum"):
        for i in range(len(reader)):
            reader.sample(i)
    recipe_file = workspace["root"] / "trusting.yaml"
    recipe_file.write_text(json.dumps(trusting.to_dict()))
    assert main(["dump", str(recipe_file), "--reverify"]) == 0
    out = capsys.readouterr().out
    assert "redoing" in out and "shard-00001" in out and "checksum mismatch" in out and "shard-00000" not in out
    shards = {r["file"] for r in json.loads((shard_dir / "manifest.json").read_text())["shards"]}
    assert len(shards) > 4 and shards <= set(hashed)  # every finished shard hashed
    assert _files(shard_dir) == original and verify(shard_dir) == []


def test_sidecar_that_disagrees_with_the_manifest_is_hashed(workspace):
    """A shard rewritten after the manifest (its sidecar's sha256 differs from the manifest's) is checked in full."""
    from eyas.data.shard_writer import check_shard

    recipe = _run(workspace, "uninterrupted")
    if not (recipe.run_dir / "shards" / "manifest.json").exists():
        dump(recipe)
    shard_dir = workspace["root"] / "sidecar-check"
    shutil.copytree(recipe.run_dir / "shards", shard_dir)
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    plan = manifest["plan"]
    sidecar = shard_dir / "shard-00002.json"
    record = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(dict(record, sha256="0" * 64)))  # same size, another recorded checksum
    assert check_shard(shard_dir, 2, full=False, expect_plan=plan) == ""  # nothing to compare with: trusted
    assert check_shard(shard_dir, 2, full=False, expect_plan=plan, recorded=manifest["shards"][2]) == "checksum mismatch (corrupt)"
    sidecar.write_text(json.dumps(record))
    assert check_shard(shard_dir, 2, full=False, expect_plan=plan, recorded=manifest["shards"][2]) == ""
    sidecar.write_text("{}")
    assert check_shard(shard_dir, 2, full=False, expect_plan=plan) == "a damaged sidecar"


def test_streamed_shards_equal_the_whole_shard_writer(workspace, tmp_path):
    """Every shard of a real dump equals, byte for byte, what `write_shard` makes of the same tensors
    (the in-memory writer the dump used before it streamed), and so does its sidecar."""
    from safetensors import safe_open

    from eyas.data.shard_format import CHECKSUM
    from eyas.data.shard_writer import write_shard

    recipe = _run(workspace, "compact-stream", "dump.low_layer_encoding=int4", "dump.teacher=topk", "dump.topk=8")
    manifest = dump(recipe)
    shard_dir = recipe.run_dir / "shards"
    assert len(manifest["shards"]) > 2
    for k, record in enumerate(manifest["shards"]):
        with safe_open(str(shard_dir / record["file"]), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys() if name != CHECKSUM}
            metadata = json.loads(f.metadata()["eyas"])
        assert metadata["shard"] == k
        assert write_shard(tmp_path, k, tensors, metadata) == record
        assert (tmp_path / record["file"]).read_bytes() == (shard_dir / record["file"]).read_bytes()
        assert (tmp_path / f"shard-{k:05d}.json").read_bytes() == (shard_dir / f"shard-{k:05d}.json").read_bytes()


@pytest.mark.parametrize("encodings", [("bf16", "fp16", "bf16"), ("fp8", "int8", "int4")])
def test_shard_writer_in_batches_is_byte_identical(tmp_path, encodings):
    """Rows handed over in uneven batches (one sample, several, the rest) make `write_shard`'s bytes."""
    import numpy as np

    from eyas.data.shard_writer import ShardWriter, write_shard

    torch.manual_seed(0)
    lengths = np.array([9, 7, 7, 4, 2, 1, 1])
    tokens = int(lengths.sum())
    x = torch.randn(tokens, 64) * 3
    rows = {"input_ids": torch.randint(0, 70000, (tokens,), dtype=torch.int32),
            "loss_mask": (torch.rand(tokens) > 0.4).to(torch.uint8),
            "topk_values": torch.randn(tokens, 4).half(), "topk_ids": torch.randint(0, 70000, (tokens, 4), dtype=torch.int32)}
    for j, encoding in enumerate(encodings):
        rows.update({f"aux_hidden.{j}{suffix}": t for suffix, t in encode(x * (j + 1), encoding).items()})
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    sample_index = np.array([40, 3, 17, 0, 8, 99, 5])
    metadata = {"schema_version": 1, "plan": "p", "shard": 4}
    whole = dict(rows, offsets=torch.from_numpy(offsets).long(), sample_index=torch.from_numpy(sample_index))
    (tmp_path / "whole").mkdir()
    expected = write_shard(tmp_path / "whole", 4, whole, metadata)
    writer = ShardWriter(tmp_path, 4, lengths, sample_index, metadata)
    for a, b in ((0, 1), (1, 4), (4, 7)):
        writer.write({name: t[offsets[a]:offsets[b]] for name, t in rows.items()}, b - a)
    assert writer.finish() == expected
    assert (tmp_path / "shard-00004.safetensors").read_bytes() == (tmp_path / "whole" / "shard-00004.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00004.json", "shard-00004.safetensors", "whole"]


def test_shard_writer_full_disk_leaves_nothing(tmp_path, monkeypatch):
    """A failed write names the file, and leaves neither a temporary file nor a sidecar claiming the shard."""
    import errno

    import numpy as np

    from eyas.data import shard_writer
    from eyas.data.shard_writer import ShardWriter

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = ShardWriter(tmp_path, 7, np.array([3]), np.array([0]), {})
    rows = {"input_ids": torch.zeros(3, dtype=torch.int32), "loss_mask": torch.ones(3, dtype=torch.uint8)}
    writer.write(rows, 1)
    monkeypatch.setattr(shard_writer.os, "fsync", no_space)
    with pytest.raises(EyasError, match=r"cannot write '.*shard-00007.safetensors': No space left on device"):
        writer.finish()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    writer = ShardWriter(tmp_path, 7, np.array([3]), np.array([0]), {})
    monkeypatch.setattr(shard_writer.os, "pwrite", no_space)
    with pytest.raises(EyasError, match=r"cannot write '.*shard-00007.safetensors': No space left on device"):
        writer.write(rows, 1)
    assert list(tmp_path.iterdir()) == []


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


def test_ranks_write_disjoint_parts(workspace, monkeypatch):
    """Two ranks run one after the other (as a SLURM array would), then a single-process finalize
    (`eyas dump --finalize`, the SLURM dump-finalize job) that never loads the target's weights."""
    single = _run(workspace, "uninterrupted")
    if not (single.run_dir / "shards" / "manifest.json").exists():
        dump(single)
    split = _run(workspace, "two-ranks")
    real_load_target = dump_module.load_target

    def no_weights(target):
        raise AssertionError("the finalize loaded the target's weights")

    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr(dump_module, "load_target", real_load_target)
        assert dump(split) is None  # rank 0 finds rank 1's part missing; rank 1 never writes the manifest
        names = {p.name for p in (split.run_dir / "shards").glob("shard-*.safetensors")}
        monkeypatch.delenv("RANK")
        monkeypatch.delenv("WORLD_SIZE")
        monkeypatch.setattr(dump_module, "load_target", no_weights)
        if rank == 0:
            assert names and all(int(n[6:11]) % 2 == 0 for n in names)
            # rank 1's shards are missing: the finalize names the first of them and writes nothing
            with pytest.raises(EyasError, match=r"--finalize: \d+ of \d+ shards of the train split .* "
                                                r"shard-00001\.safetensors \(missing\)"):
                dump(split, finalize=True)
            assert not (split.run_dir / "shards" / "manifest.json").exists()
    manifest = dump(split, finalize=True)
    assert _files(split.run_dir / "shards") == _files(single.run_dir / "shards")
    expected = json.loads((single.run_dir / "shards" / "manifest.json").read_text())
    assert manifest["shards"] == expected["shards"] and manifest["vocab"] == expected["vocab"]


def _free_port() -> int:
    """A port nothing listens on now (bound to port 0, then released), instead of a fixed one another run may hold."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.cluster
def test_torchrun_two_processes_equal_one(workspace):
    single = _run(workspace, "uninterrupted")
    if not (single.run_dir / "shards" / "manifest.json").exists():
        dump(single)
    two = _run(workspace, "torchrun")
    recipe_file = workspace["root"] / "torchrun.yaml"
    recipe_file.write_text(json.dumps(two.to_dict()))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
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


# One `eyas dump` in a fresh process; prints the peak RSS of the dump (VmHWM, reset once the target
# is loaded: ru_maxrss would include the parent's RSS at fork and the loading) and its largest
# shard. "whole" swaps in the writer the dump used before it streamed (every batch kept,
# concatenated at the end of the shard, serialised by `write_shard` while the next shard runs), so
# the test shows that the measurement sees a shard held in memory.
_PEAK_RSS_CHILD = """
import json, sys
import numpy as np, torch
from eyas.config import load_recipe
from eyas.data import dump as dump_module
from eyas.data.shard_writer import write_shard
from eyas.targets import load_target

class WholeShardWriter:
    def __init__(self, directory, index, lengths, sample_index, metadata):
        self.where, self.lengths, self.sample_index, self.parts = (directory, index, metadata), lengths, sample_index, {}
    def write(self, rows, samples):
        for name, t in rows.items():
            self.parts.setdefault(name, []).append(t)
    def finish(self):
        tensors = {name: torch.cat(parts) for name, parts in self.parts.items()}
        tensors["offsets"] = torch.from_numpy(np.concatenate([[0], np.cumsum(self.lengths)])).long()
        tensors["sample_index"] = torch.from_numpy(np.asarray(self.sample_index, dtype=np.int64))
        directory, index, metadata = self.where
        return write_shard(directory, index, tensors, metadata)
    def abort(self):
        pass

def status(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024

if sys.argv[2] == "whole":
    dump_module.ShardWriter = WholeShardWriter
recipe = load_recipe(sys.argv[1])
model, tokenizer = load_target(recipe.target)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = status("VmRSS")
manifest = dump_module.dump(recipe, model=model, tokenizer=tokenizer)
print(json.dumps({"peak_rss": status("VmHWM"), "start_rss": start, "largest_shard": max(r["bytes"] for r in manifest["shards"])}))
"""


def _wide_recipe(root: Path, name: str, *extra: str):
    return load_recipe(None, [
        f"target.path={root / 'target'}", f"data.source={root / 'rows.jsonl'}", f"run.output_dir={root}", f"run.name={name}",
        "data.max_length=128", "data.overflow=truncate", "data.heldout_fraction=0.0", "dump.layers=[0, 1, 1]",
        "dump.encoding=bf16", "dump.token_budget=2048", "dump.draft_vocab_size=64", *extra,
    ])


@pytest.fixture(scope="module")
def wide_workspace(tmp_path_factory):
    """A one-layer target of hidden size 1024 (8 KB of bf16 features per token, little compute) and
    256 samples of exactly 128 tokens: 32,768 tokens, 16 samples to a 2,048-token batch."""
    import random

    from fixtures import build_tiny_target

    root = tmp_path_factory.mktemp("dump-memory")
    build_tiny_target(root / "target", "llama", hidden_size=1024, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=8)
    rng = random.Random(0)
    words = "the hawk flies over a mountain river while quick brown foxes sleep in sunny parks".split()
    rows = [{"messages": [{"role": "user", "content": "Tell me a story."},
                          {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(200))}]}
            for _ in range(256)]
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recipe = _wide_recipe(root, "prepared")
    prepare(recipe)
    assert sorted({len(x) for x in load_prepared(recipe.run_dir, "train")["input_ids"]}) == [128]
    return root


def _peak_rss(root: Path, writer: str, shard_tokens: int) -> dict:
    recipe = _wide_recipe(root, f"{writer}-{shard_tokens}", f"dump.shard_tokens={shard_tokens}")
    shutil.copytree(root / "prepared" / "prepared", recipe.run_dir / "prepared")
    recipe_file = root / f"{writer}-{shard_tokens}.yaml"
    recipe_file.write_text(json.dumps(recipe.to_dict()))
    # glibc hands blocks over 64 KB straight back to the OS when they are freed, so the peak counts
    # live memory rather than what the allocator keeps for reuse (which varies by tens of MB per run).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS_CHILD, str(recipe_file), writer], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_peak_host_memory_does_not_grow_with_the_shard(wide_workspace):
    """A whole dump's peak RSS, in fresh processes: shards of 4,096 and of 32,768 tokens (8x: 268 MB)
    need the same host memory (each batch goes to the file as it comes); the whole-shard writer the
    dump used before needs several shards' worth more at 32,768, so the measurement would see it."""
    small = _peak_rss(wide_workspace, "stream", 4096)
    large = _peak_rss(wide_workspace, "stream", 32768)
    whole = _peak_rss(wide_workspace, "whole", 32768)
    shard = large["largest_shard"]
    assert shard > 7.9 * small["largest_shard"] and shard > 250e6
    assert small["peak_rss"] - small["start_rss"] > 16e6  # the dump's own peak: at least its 2,048-token batch
    assert large["peak_rss"] - small["peak_rss"] < 0.1 * shard, (small, large)
    assert whole["peak_rss"] - large["peak_rss"] > 1.5 * shard, (large, whole)
