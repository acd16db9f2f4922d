"""Issue 15, item 1: training verifies its shards (tiny targets, real dumps).

A corrupt byte in a feature tensor, in `offsets` or in `input_ids`, and a shard copied in from a
dump of another target of the same shapes (sidecar and all), stop the reader before any batch
that would use them, with one line naming the file, what differs and the fix; `eyas dump`
redoes the foreign shard; `eyas verify` is the full check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eyas.config import load_recipe
from eyas.data.dump import dump
from eyas.data.prepare import prepare
from eyas.data.shard_format import CHECKSUM, read_header
from eyas.data.shard_reader import ShardReader
from eyas.data.shard_verify import verify
from eyas.errors import EyasError
from eyas.train.loader import TokenBudgetLoader

ROWS = 40


def _recipe(root: Path, target: Path, name: str, *extra: str):
    return load_recipe(None, [
        f"target.path={target}", f"data.source={root / 'rows.jsonl'}", f"run.output_dir={root}", f"run.name={name}",
        "data.max_length=96", "data.heldout_fraction=0.1", "dump.shard_tokens=600", "dump.token_budget=400",
        "dump.draft_vocab_size=64", "dump.layers=[0, 3, 6]", "dump.encoding=fp8", *extra,
    ])


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, tiny_llama_dir):
    """The same prepared rows dumped from the tiny target and from another one of the same shapes."""
    from fixtures import build_tiny_target

    from eyas.data.sources import chitchat_rows

    root = tmp_path_factory.mktemp("reliability_shards")
    rows = [r for r in chitchat_rows() if any(m["role"] == "assistant" for m in r["messages"])][:ROWS]
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    other_target = build_tiny_target(root / "other-target", "llama", seed=1)  # same shapes, other weights
    main = _recipe(root, tiny_llama_dir, "main")
    prepare(main)
    dump(main)
    other = _recipe(root, other_target, "other")
    shutil.copytree(main.run_dir / "prepared", other.run_dir / "prepared")
    dump(other)
    return {"root": root, "main": main, "other": other, "target": tiny_llama_dir}


def _copy(dumps, name: str):
    """A fresh run `name` holding a copy of the main run's prepared data and shards."""
    recipe = _recipe(dumps["root"], dumps["target"], name)
    shutil.rmtree(recipe.run_dir, ignore_errors=True)
    shutil.copytree(dumps["main"].run_dir, recipe.run_dir)
    return recipe


def _flip(path: Path, tensor: str, at: float = 0.5) -> int:
    """Flip one byte inside `tensor`'s data (at this fraction of it); returns the token row it is in."""
    header = read_header(path)
    begin, end = header[tensor]["data_offsets"]
    base = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    offset = begin + int((end - begin) * at)
    data = bytearray(path.read_bytes())
    data[base + offset] ^= 0x5A
    path.write_bytes(bytes(data))
    row_bytes = (end - begin) // header[tensor]["shape"][0]
    return (offset - begin) // row_bytes


def _batches_until_error(reader: ShardReader) -> tuple[list[list[int]], EyasError | None]:
    """Walk one epoch the way TokenBudgetLoader does; the sample indices of each batch read before an error."""
    loader = TokenBudgetLoader(reader, token_budget=300, seed=0)
    done = []
    for indices in loader._rank_batches():
        try:
            for i in indices:
                reader.sample(int(i))
        except EyasError as exc:
            return done, exc
        done.append([int(i) for i in indices])
    return done, None


def _sample_at(reader: ShardReader, shard: int, token: int) -> int:
    """The global sample index holding token `token` of shard `shard`."""
    offsets = reader.shard_offsets(shard)
    row = int(torch.searchsorted(offsets, torch.tensor(token), right=True)) - 1
    return int(reader._starts[shard]) + row


@pytest.mark.parametrize("tensor", ["aux_hidden.1", "last_hidden", "input_ids", "aux_hidden.2.scale"])
def test_corrupt_byte_stops_the_reader_before_the_batch_that_reads_it(dumps, tensor):
    recipe = _copy(dumps, f"flip-{tensor}")
    shard = recipe.run_dir / "shards" / "shard-00001.safetensors"
    token = _flip(shard, tensor)
    reader = ShardReader(recipe.run_dir / "shards")  # same size, intact header: opening is fine
    bad = _sample_at(reader, 1, token)
    done, error = _batches_until_error(reader)
    assert error is not None, "the corrupt byte was read without a word"
    message = str(error)
    assert f"shard file '{shard}' is corrupt" in message and "does not match its checksum" in message
    assert "rerun `eyas dump RECIPE`" in message and "\n" not in message
    assert all(bad not in batch for batch in done)  # no batch that holds the sample was handed out
    assert verify(recipe.run_dir / "shards") == [f"{shard}: checksum mismatch (corrupt)"]


@pytest.mark.parametrize("element", [1, -1])
def test_corrupt_offsets_are_an_error_not_a_traceback(dumps, element):
    recipe = _copy(dumps, f"offsets{element}")
    shard = recipe.run_dir / "shards" / "shard-00002.safetensors"
    header = read_header(shard)
    n = header["offsets"]["shape"][0]
    _flip(shard, "offsets", at=((element % n) + 0.0) / n)  # the low byte of that offset
    reader = ShardReader(recipe.run_dir / "shards")
    first = int(reader._starts[2])
    with pytest.raises(EyasError, match=r"shard-00002.safetensors' is corrupt: its offsets .*rerun `eyas dump"):
        reader.sample(first)
    problems = verify(recipe.run_dir / "shards")
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: ")


def test_foreign_shard_of_a_same_shape_target_is_refused_at_open_and_redone_by_dump(dumps, capsys):
    recipe = _copy(dumps, "foreign")
    shards = recipe.run_dir / "shards"
    theirs = dumps["other"].run_dir / "shards"
    ours = (shards / "shard-00001.safetensors").read_bytes()
    # the hard case: the same size, so no size check can see it; sidecar copied along
    assert (theirs / "shard-00001.safetensors").stat().st_size == len(ours)
    assert (theirs / "shard-00001.safetensors").read_bytes() != ours
    for suffix in (".safetensors", ".json"):
        shutil.copy(theirs / f"shard-00001{suffix}", shards / f"shard-00001{suffix}")
    with pytest.raises(EyasError) as caught:
        ShardReader(shards)
    message = str(caught.value)
    assert "shard-00001.safetensors' is from another dump" in message and "plan fingerprint" in message
    assert "rerun `eyas dump RECIPE` to repair" in message and "\n" not in message
    assert any("shard-00001.safetensors: from another dump" in p for p in verify(shards))
    capsys.readouterr()
    dump(recipe)  # the sidecar agrees with the foreign file: only its header tells
    out = capsys.readouterr().out
    assert "redoing" in out and "shard-00001" in out and "from another dump" in out
    assert (shards / "shard-00001.safetensors").read_bytes() == ours
    assert verify(shards) == []
    ShardReader(shards)


def test_trainer_batches_stop_with_the_error(dumps):
    """The trainer's own path (open_shards + BatchStream): the error arrives instead of the batch."""
    from eyas.targets import load_target_config, load_tokenizer, target_identity
    from eyas.train.data import open_shards
    from eyas.train.loader import BatchStream

    recipe = _copy(dumps, "stream")
    shard = recipe.run_dir / "shards" / "shard-00000.safetensors"
    _flip(shard, "aux_hidden.0")
    identity = target_identity(load_target_config(str(dumps["target"])), load_tokenizer(recipe.target))
    opened = open_shards(recipe.run_dir, "eagle3", 64, [0, 3, 6], identity)
    stream = BatchStream(TokenBudgetLoader(opened["train"], token_budget=300, seed=0), prefetch=2)
    with pytest.raises(EyasError, match="shard-00000.safetensors' is corrupt"):
        for _ in range(200):
            next(stream)
    stream.close()


def test_legacy_shards_without_sample_checksums_are_hashed_at_first_read(dumps):
    """Shards written before per-sample checksums: the whole file's sha256 at its first read."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save

    from eyas.data.dump import finalize_split

    recipe = _copy(dumps, "legacy")
    shards = recipe.run_dir / "shards"
    manifest = json.loads((shards / "manifest.json").read_text())
    for record in manifest["shards"]:
        path = shards / record["file"]
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != CHECKSUM}
            metadata = f.metadata()
        payload = save(tensors, metadata=metadata)
        path.write_bytes(payload)
        record.update(bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        path.with_suffix(".json").write_text(json.dumps(record))
    header = {k: v for k, v in manifest.items() if k not in ("shards", "index", "plan")}
    finalize_split(shards, len(manifest["shards"]), header, wait=False, plan=manifest["plan"])
    reader = ShardReader(shards)
    reader.sample(0)  # intact: reads fine
    _flip(shards / "shard-00001.safetensors", "last_hidden")
    reader = ShardReader(shards)
    with pytest.raises(EyasError, match="shard-00001.safetensors' is corrupt: its sha256 differs"):
        for i in range(len(reader)):
            reader.sample(i)


def test_eyas_verify_command(dumps, capsys):
    from eyas.cli.main import main

    good = dumps["main"]
    assert main(["verify", str(good.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "checksums and offsets all match" in out and str(good.run_dir / "shards") in out
    recipe = _copy(dumps, "verify-bad")
    shard = recipe.run_dir / "shards" / "heldout" / "shard-00000.safetensors"
    _flip(shard, "input_ids")
    recipe_file = recipe.run_dir / "r.yaml"
    recipe_file.write_text(json.dumps(recipe.to_dict()))
    assert main(["verify", str(recipe_file)]) == 2
    captured = capsys.readouterr()
    assert f"eyas verify: {shard}: checksum mismatch (corrupt)" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eyas: error: 1 problem(s)") and "eyas dump RECIPE" in err[0]


def test_verification_off_reads_what_verification_refuses(dumps):
    """The switch the benchmark compares against: verify=False keeps only the size checks."""
    recipe = _copy(dumps, "off")
    _flip(recipe.run_dir / "shards" / "shard-00000.safetensors", "last_hidden")
    unchecked = ShardReader(recipe.run_dir / "shards", verify=False)
    for i in range(len(unchecked)):
        unchecked.sample(i)
    done, error = _batches_until_error(ShardReader(recipe.run_dir / "shards"))
    assert error is not None
