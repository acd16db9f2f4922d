"""The trainer's loader (eyas.train.loader): batches read as stored codes and decoded on the device
are bitwise the CPU decode's; worker processes keep the TokenBudgetLoader's order, its exact
resume and the shard errors' messages; workers outlive the trainer's stop signals."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas.config import load_recipe
from eyas.data.dump import finalize_split
from eyas.data.shard_format import SCHEMA_VERSION, encode, read_header
from eyas.data.shard_reader import ShardReader
from eyas.data.shard_writer import write_shard
from eyas.errors import EyasError
from eyas.train.loader import STORED, BatchStream, TokenBudgetLoader, pad_batch, read_batch, stored_bytes, to_device

HIDDEN = 64
TOPK = 4
VOCAB = 1000  # uint16 ids on disk
REPO = Path(__file__).resolve().parent.parent


def _feature(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Random features of varied per-token magnitude, every 17th token all zero."""
    x = torch.randn(tokens, HIDDEN, generator=gen) * torch.exp(2 * torch.randn(tokens, 1, generator=gen))
    x[::17] = 0.0
    return x


def make_dump(directory: Path, lengths: list[int], aux: list[str], last: str, per_shard: int = 20) -> Path:
    """Shards of random features (varied per-token magnitudes, some all-zero tokens), fused layers
    in the given encodings, last hidden, teacher top-k, ids as uint16."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(len(lengths))
    starts = list(range(0, len(lengths), per_shard))
    for k, first in enumerate(starts):
        ids = list(range(first, min(first + per_shard, len(lengths))))
        tokens = sum(lengths[i] for i in ids)

        tensors = {
            "input_ids": torch.randint(0, VOCAB, (tokens,), generator=gen, dtype=torch.int32).to(torch.uint16),
            "loss_mask": torch.randint(0, 2, (tokens,), generator=gen, dtype=torch.uint8),
            "offsets": torch.tensor([0] + np.cumsum([lengths[i] for i in ids]).tolist()),
            "sample_index": torch.tensor(ids),
            "topk_values": torch.randn(tokens, TOPK, generator=gen).to(torch.float16),
            "topk_ids": torch.randint(0, VOCAB, (tokens, TOPK), generator=gen, dtype=torch.int32).to(torch.uint16),
        }
        for name, enc in [(f"aux_hidden.{j}", e) for j, e in enumerate(aux)] + [("last_hidden", last)]:
            for suffix, t in encode(_feature(tokens, gen), enc).items():
                tensors[name + suffix] = t
        write_shard(directory, k, tensors, {"schema_version": SCHEMA_VERSION, "plan": "test-plan", "shard": k})
    header = {"schema_version": SCHEMA_VERSION, "target_identity": "synthetic", "target_path": "none",
              "hidden_size": HIDDEN, "layers": [0, 1, 2], "encoding": last,
              "features": {"aux_hidden": {"layers": [0, 1, 2], "encodings": aux, "shape": [3 * HIDDEN]},
                           "last_hidden": {"encoding": last, "shape": [HIDDEN]},
                           "topk_values": {"encoding": "fp16", "shape": [TOPK]},
                           "topk_ids": {"encoding": "ids", "shape": [TOPK]}}}
    finalize_split(directory, len(starts), header, wait=False, plan="test-plan")
    return directory


LENGTHS = np.random.default_rng(0).integers(3, 60, size=90).tolist()


@pytest.fixture(scope="module")
def fp8_dump(tmp_path_factory) -> Path:
    return make_dump(tmp_path_factory.mktemp("loader-fp8"), LENGTHS, ["fp8"] * 3, "fp8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(_bits(a[key]), _bits(b[key])), f"{key} differs"


def _ids(batch: dict) -> list[int]:
    return batch["input_ids"][:, :3].tolist()


@pytest.mark.parametrize("aux,last", [(["fp8"] * 3, "fp8"), (["int4", "int8", "int8"], "int8"),
                                      (["bf16"] * 3, "fp16"), (["int4"] * 3, "bf16")])
def test_codes_decoded_on_the_device_are_bitwise_the_cpu_decode(tmp_path, aux, last):
    reader = ShardReader(make_dump(tmp_path / "d", LENGTHS, aux, last))
    loader = TokenBudgetLoader(reader, token_budget=200, seed=1)
    checked = 0
    for _, _, indices in loader.plan():
        old = pad_batch([reader.sample(int(i)) for i in indices])  # decoded per sample on the CPU, then padded
        codes = read_batch(reader, indices)
        assert codes["aux_hidden.0"].dtype == encode(torch.zeros(1, 64), aux[0])[""].dtype  # stored, not decoded
        assert codes["input_ids"].dtype == torch.int32  # uint16 on disk, widened for the device copy
        new = to_device(codes, torch.device("cpu"))
        assert_bitwise_equal(new, old)  # the padding included: it decodes to +0.0 in every encoding
        assert STORED not in new
        checked += int(len(indices) > 1 and bool((old["attention_mask"] == 0).any()))
    assert checked > 3  # padded batches were compared
    assert [_ids(b) for b in TokenBudgetLoader(reader, 200, seed=1)] == [
        _ids(pad_batch([reader.sample(int(i)) for i in idx])) for _, _, idx in TokenBudgetLoader(reader, 200, seed=1).plan()]


def test_fp8_codes_carry_a_quarter_of_the_decoded_bytes(fp8_dump):
    reader = ShardReader(fp8_dump)
    indices = next(TokenBudgetLoader(reader, token_budget=400, seed=0).plan())[2]
    codes = read_batch(reader, indices)
    decoded = to_device(codes, torch.device("cpu"))
    features = sum(codes[k].numel() * codes[k].element_size() for k in codes if k.startswith(("aux", "last")))
    assert features < 0.3 * sum(decoded[k].numel() * decoded[k].element_size() for k in ("aux_hidden", "last_hidden"))
    assert stored_bytes(codes) < 0.4 * stored_bytes(decoded)


def _take(stream: BatchStream, n: int) -> list[tuple[dict, dict]]:
    out = [next(stream) for _ in range(n)]
    stream.close()
    return [(to_device(b, torch.device("cpu")), p) for b, p in out]


def test_workers_give_the_same_batches_in_the_same_order_as_in_process(fp8_dump):
    reader = ShardReader(fp8_dump)
    per_epoch = len(TokenBudgetLoader(reader, token_budget=150, seed=4, rank=1, world_size=2))
    n = 2 * per_epoch + 3  # across two epoch boundaries

    def run(workers: int, prefetch: int) -> list[tuple[dict, dict]]:
        loader = TokenBudgetLoader(ShardReader(fp8_dump), token_budget=150, seed=4, rank=1, world_size=2)
        return _take(BatchStream(loader, prefetch=prefetch, workers=workers), n)

    reference = run(0, 0)
    expected = []
    for epoch in range(3):
        loader = TokenBudgetLoader(reader, token_budget=150, seed=4, rank=1, world_size=2)
        loader.set_epoch(epoch)
        expected += list(loader)
    for (batch, _), want in zip(reference, expected):
        assert_bitwise_equal(batch, want)
    assert [p["epoch"] for _, p in reference] == [0] * per_epoch + [1] * per_epoch + [2] * 3
    assert [p["position"] for _, p in reference][:per_epoch + 1] == list(range(1, per_epoch + 1)) + [1]
    for workers, prefetch in [(0, 2), (2, 2), (1, 1)]:
        got = run(workers, prefetch)
        for (batch, position), (want, want_position) in zip(got, reference, strict=True):
            assert_bitwise_equal(batch, want)
            assert position == want_position


@pytest.mark.parametrize("stop_after", [5, "epoch_end"])
def test_resume_with_workers_continues_exactly(fp8_dump, stop_after):
    def loader() -> TokenBudgetLoader:
        return TokenBudgetLoader(ShardReader(fp8_dump), token_budget=150, seed=2, rank=0, world_size=2)

    per_epoch = len(loader())
    taken = per_epoch if stop_after == "epoch_end" else stop_after
    whole = _take(BatchStream(loader(), prefetch=2, workers=2), taken + per_epoch + 2)
    first = BatchStream(loader(), prefetch=3, workers=2)
    consumed = [next(first) for _ in range(taken)]  # the workers have read further ahead
    first.close()
    state = consumed[-1][1]  # what a checkpoint after this batch records
    assert state["position"] == taken and state["epoch"] == 0
    again = loader()
    again.load_state_dict(state)
    resumed = _take(BatchStream(again, prefetch=2, workers=2), per_epoch + 2)
    for (batch, position), (want, want_position) in zip(resumed, whole[taken:], strict=True):
        assert_bitwise_equal(batch, want)
        assert position == want_position


def _flip_in_sample(directory: Path, reader: ShardReader, sample: int, tensor: str) -> None:
    """Flip one byte of `tensor` inside sample `sample`'s rows."""
    shard, row = int(reader._index["shard"][sample]), int(reader._index["row"][sample])
    path = directory / reader.manifest["shards"][shard]["file"]
    header = read_header(path)
    begin, end = header[tensor]["data_offsets"]
    row_bytes = (end - begin) // header[tensor]["shape"][0]
    token = int(reader.shard_offsets(shard)[row])
    data = bytearray(path.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + begin + token * row_bytes + 1] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_sample_stops_the_stream_with_the_readers_message(tmp_path, workers):
    directory = make_dump(tmp_path / "d", LENGTHS, ["fp8"] * 3, "fp8")
    reader = ShardReader(directory)
    plan = [idx for _, _, idx in TokenBudgetLoader(reader, token_budget=150, seed=0).plan()]
    bad = int(plan[4][0])  # in the fifth batch
    _flip_in_sample(directory, reader, bad, "aux_hidden.1")
    stream = BatchStream(TokenBudgetLoader(ShardReader(directory), token_budget=150, seed=0), prefetch=2, workers=workers)
    delivered = []
    with pytest.raises(EyasError) as caught:
        for _ in range(len(plan)):
            delivered.append(next(stream)[0])
    stream.close()
    message = str(caught.value)
    assert "is corrupt" in message and "does not match its checksum" in message and "rerun `eyas dump RECIPE`" in message
    assert "\n" not in message and "worker" not in message  # the reader's one line, not a worker traceback
    assert len(delivered) == 4  # every batch before it, none after


@pytest.mark.parametrize("workers", [0, 2])
def test_no_batch_for_this_rank_is_an_error(fp8_dump, workers):
    loader = TokenBudgetLoader(ShardReader(fp8_dump), token_budget=10**6, seed=0, rank=1, world_size=2)  # one batch
    stream = BatchStream(loader, prefetch=2, workers=workers)
    with pytest.raises(EyasError, match="yields no batch for this process"):
        next(stream)
    stream.close()


def test_workers_outlive_the_trainers_stop_signals(fp8_dump):
    """Slurm sends SIGTERM to every process of a job: the workers must stay up while the trainer
    finishes its step and checkpoints (a dead worker would fail the next batch instead)."""
    loader = TokenBudgetLoader(ShardReader(fp8_dump), token_budget=150, seed=0)
    existing = set(multiprocessing.active_children())
    stream = BatchStream(loader, prefetch=1, workers=2)
    next(stream)
    workers = set(multiprocessing.active_children()) - existing
    assert len(workers) == 2
    for p in workers:
        os.kill(p.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(p.is_alive() for p in workers)
    for _ in range(2 * len(loader)):  # beyond the read-ahead: the workers must keep reading
        next(stream)
    stream.close()
    assert not any(p.is_alive() for p in workers)  # closed with the stream


def test_loader_workers_recipe_key():
    assert load_recipe(None, []).train.loader_workers == 2
    assert load_recipe(None, ["train.loader_workers=0"]).train.loader_workers == 0
    with pytest.raises(EyasError, match="train.loader_workers' must be >= 0"):
        load_recipe(None, ["train.loader_workers=-1"])


def test_bench_loader_smoke(tmp_path):
    out = tmp_path / "bench_loader.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_loader.py"), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("BENCH ")]
    names = {parts[1] for parts in lines}
    assert {"loader_tokens_per_s_new", "loader_tokens_per_s_old", "loader_vs_gpu_step_demand"} <= names
    assert all(float(parts[2]) > 0 for parts in lines)
    figures = json.loads(out.read_text())["figures"]
    assert figures["bytes_to_device_per_batch_new"] < figures["bytes_to_device_per_batch_old"] / 2
