"""Shard reader and TokenBudgetLoader on synthetic shards (no model): determinism, ranks, resume."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
import torch

from eyas.data.batches import budget_batches
from eyas.data.dump import finalize_split
from eyas.data.shard_format import SCHEMA_VERSION, encode
from eyas.data.shard_reader import ShardReader
from eyas.data.shard_writer import write_shard
from eyas.errors import EyasError
from eyas.train.loader import TokenBudgetLoader

HIDDEN = 8


def make_dump(directory, lengths: list[int], per_shard: int = 50, encoding: str = "bf16") -> dict:
    """Shards whose features encode (sample id, position), so every value can be checked."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = [list(range(s, min(s + per_shard, len(lengths)))) for s in range(0, len(lengths), per_shard)]
    for k, ids in enumerate(shards):
        tok = [torch.arange(lengths[i]) for i in ids]
        sample = torch.cat([torch.full((lengths[i],), i) for i in ids])
        pos = torch.cat(tok)
        feature = torch.stack([sample.float(), pos.float()] + [torch.zeros_like(pos, dtype=torch.float)] * (HIDDEN - 2), -1)
        tensors = {
            "input_ids": (sample * 7 + pos).to(torch.int32), "loss_mask": (pos % 2).to(torch.uint8),
            "offsets": torch.tensor([0] + np.cumsum([lengths[i] for i in ids]).tolist()),
            "sample_index": torch.tensor(ids), "last_hidden": encode(feature, encoding)[""],
        }
        write_shard(directory, k, tensors, {"shard": k})
    header = {"schema_version": SCHEMA_VERSION, "target_identity": "synthetic", "target_path": "none",
              "hidden_size": HIDDEN, "layers": [], "encoding": encoding,
              "features": {"last_hidden": {"encoding": encoding, "shape": [HIDDEN]}}}
    return finalize_split(directory, len(shards), header, wait=False)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, size=230).tolist()
    directory = tmp_path_factory.mktemp("synthetic")
    make_dump(directory, lengths)
    return directory, lengths


def _ids(batch) -> list[int]:
    """Sample ids of a batch (read back from the features)."""
    return [int(x) for x in batch["last_hidden"][:, 0, 0]]


def test_sample_contents_and_padding(dump_dir):
    directory, lengths = dump_dir
    reader = ShardReader(directory, expect_identity="synthetic")
    assert len(reader) == 230 and reader.lengths.tolist() == lengths
    s = reader.sample(123)
    assert s["input_ids"].tolist() == [123 * 7 + p for p in range(lengths[123])]
    assert s["last_hidden"][:, 1].tolist() == list(range(lengths[123]))
    assert s["loss_mask"].dtype == torch.float32
    batch = next(iter(TokenBudgetLoader(reader, token_budget=200, seed=1)))
    for b, sid in enumerate(_ids(batch)):
        n = lengths[sid]
        assert int(batch["attention_mask"][b].sum()) == n
        assert batch["input_ids"][b, :n].tolist() == [sid * 7 + p for p in range(n)]
        assert not batch["last_hidden"][b, n:].any() and not batch["loss_mask"][b, n:].any()


def test_epoch_covers_every_sample_once_within_budget(dump_dir):
    directory, lengths = dump_dir
    loader = TokenBudgetLoader(ShardReader(directory), token_budget=150, seed=3, window=64)
    seen = []
    for batch in loader:
        seen += _ids(batch)
        rows, width = batch["input_ids"].shape
        assert rows * width <= 150 or rows == 1
    assert sorted(seen) == list(range(230))
    assert loader.epoch == 1 and loader.position == 0  # a finished epoch moves on


def test_shuffle_is_deterministic_by_seed_and_epoch(dump_dir):
    directory, _ = dump_dir
    reader = ShardReader(directory)

    def order(seed, epoch):
        loader = TokenBudgetLoader(reader, token_budget=150, seed=seed)
        loader.set_epoch(epoch)
        return [_ids(b) for b in loader]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    assert sorted(sum(order(0, 1), [])) == list(range(230))


def test_ranks_take_disjoint_equal_parts(dump_dir):
    directory, _ = dump_dir
    reader = ShardReader(directory)
    parts = []
    for rank in range(3):
        loader = TokenBudgetLoader(reader, token_budget=150, seed=5, rank=rank, world_size=3)
        parts.append([_ids(b) for b in loader])
    assert len({len(p) for p in parts}) == 1  # same number of steps on every rank
    flat = [sorted(sum(p, [])) for p in parts]
    assert not set(flat[0]) & set(flat[1]) and not set(flat[1]) & set(flat[2]) and not set(flat[0]) & set(flat[2])
    whole = [_ids(b) for b in TokenBudgetLoader(reader, token_budget=150, seed=5)]
    dealt = sum((whole[g * 3:(g + 1) * 3] for g in range(len(whole) // 3)), [])
    assert [b for p in zip(*parts) for b in p] == dealt  # the global order, dealt round robin
    assert len(TokenBudgetLoader(reader, token_budget=150, seed=5, rank=1, world_size=3)) == len(parts[1])


def test_resume_continues_exactly(dump_dir):
    directory, _ = dump_dir
    reader = ShardReader(directory)
    loader = TokenBudgetLoader(reader, token_budget=120, seed=9, rank=1, world_size=2)
    loader.set_epoch(2)
    full = [_ids(b) for b in loader]
    first = TokenBudgetLoader(reader, token_budget=120, seed=9, rank=1, world_size=2)
    first.set_epoch(2)
    taken = []
    for batch in first:
        taken.append(_ids(batch))
        if len(taken) == 5:
            break
    state = first.state_dict()
    assert state["epoch"] == 2 and state["position"] == 5
    again = TokenBudgetLoader(reader, token_budget=120, seed=9, rank=1, world_size=2)
    again.load_state_dict(state)
    again.set_epoch(2)  # a trainer's epoch loop calls this again: it must not rewind
    assert taken + [_ids(b) for b in again] == full
    other = TokenBudgetLoader(reader, token_budget=999, seed=9, rank=1, world_size=2)
    with pytest.raises(EyasError, match="token_budget"):
        other.load_state_dict(state)


def _steps(reader, world: int, accum: int, state: dict | None = None, epoch: int = 1) -> list[list[int]]:
    """The samples of each optimizer step of the epoch: every rank's micro-batches, pooled and sorted."""
    loaders = [TokenBudgetLoader(reader, token_budget=120, seed=9, rank=r, world_size=world, grad_accum=accum)
               for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(epoch)
    per_rank = [[_ids(b) for b in loader] for loader in loaders]
    micro = [list(zip(*[iter(batches)] * accum)) for batches in per_rank]  # each rank's batches, a step at a time
    return [sorted(i for rank in step for batch in rank for i in batch) for step in zip(*micro)]


@pytest.mark.parametrize("saved, resumed", [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 2), (4, 1)), ((4, 1), (1, 4))])
def test_resume_on_another_number_of_processes_takes_the_same_samples_per_step(dump_dir, saved, resumed):
    """A step's global batch is the same samples for any split of the group (processes x micro-batches),
    and a position saved by N processes continues on M: no sample skipped or seen twice in the epoch."""
    reader = ShardReader(dump_dir[0])
    (n, accum_n), (m, accum_m) = saved, resumed
    whole = _steps(reader, n, accum_n)
    assert whole == _steps(reader, m, accum_m) and len(whole) >= 3
    first = TokenBudgetLoader(reader, token_budget=120, seed=9, rank=n - 1, world_size=n, grad_accum=accum_n)
    first.set_epoch(1)
    list(islice(first, 2 * accum_n))  # two optimizer steps of the last rank
    assert whole[:2] + _steps(reader, m, accum_m, state=first.state_dict()) == whole


def test_resume_on_another_group_size_is_refused(dump_dir):
    reader = ShardReader(dump_dir[0])
    state = TokenBudgetLoader(reader, token_budget=120, seed=9, world_size=1).state_dict()
    with pytest.raises(EyasError, match="group_size=1"):
        TokenBudgetLoader(reader, token_budget=120, seed=9, rank=0, world_size=2).load_state_dict(state)


def test_budget_batches_longest_first():
    lengths = np.array([10, 9, 5, 5, 5, 40, 1])
    order = np.argsort(-lengths, kind="stable")
    batches = budget_batches(order, lengths, 20)
    assert [b.tolist() for b in batches] == [[5], [0, 1], [2, 3, 4, 6]]


def test_time_to_first_batch_does_not_read_every_shard(tmp_path):
    lengths = [4] * 5000
    make_dump(tmp_path / "d", lengths, per_shard=100)
    reader = ShardReader(tmp_path / "d")
    next(iter(TokenBudgetLoader(reader, token_budget=64, seed=0)))
    assert len(reader._handles) <= 16  # only the shards the first batch touched were opened


def test_full_disk_is_a_clear_error_naming_the_file(tmp_path, monkeypatch):
    import errno
    import os

    from eyas.data import shard_writer

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_writer.os, "fsync", no_space)
    tensors = {"input_ids": torch.zeros(4, dtype=torch.int32), "loss_mask": torch.ones(4, dtype=torch.uint8),
               "offsets": torch.tensor([0, 4]), "sample_index": torch.tensor([0])}
    with pytest.raises(EyasError, match=r"cannot write '.*shard-00007.safetensors': No space left on device"):
        write_shard(tmp_path, 7, tensors, {})
    assert os.listdir(tmp_path) == []  # no temporary file left behind, no sidecar claiming the shard
