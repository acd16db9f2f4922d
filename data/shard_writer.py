"""Writing a dump's files: a shard whole (`write_shard`) or as its batches arrive (`ShardWriter`), with
its sidecar; the index; the check a rerun of the dump makes of a shard already written
(`check_shard`); and rank 0's wait for the other ranks' shards. The layout written is
`eyas.data.shard_format`'s.

`eyas dump` writes a shard as its batches arrive (`ShardWriter`: header first, rows at their
offsets), so its host memory does not grow with the shard; the bytes equal `write_shard`'s. Each
file is written under a temporary name and renamed into place, the sidecar after its shard, so a
shard is done when both exist and agree: what `check_shard` asks of every shard on a rerun.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.shard_format import CHECKSUM, INDEX, header_problem, read_header, record_problem, rows_bytes, sample_checksums, shard_name
from eyas.errors import EyasError
from eyas.io import _fsync_dir, _write_error, atomic_write_bytes, atomic_write_json, sha256_file, temp_name


def write_shard(directory: Path, index: int, tensors: dict[str, torch.Tensor], metadata: dict) -> dict:
    """Serialise one shard (bytes are deterministic for equal tensors), write it and its sidecar."""
    from safetensors.torch import save

    tensors = dict(tensors)
    tensors[CHECKSUM] = sample_checksums(tensors)
    # One metadata key holding sorted JSON: safetensors writes several keys in a per-process
    # random (hash map) order, which would make equal shards differ byte for byte.
    payload = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"eyas": json.dumps(metadata, sort_keys=True)})
    record = {
        "file": shard_name(index), "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
        "num_samples": int(tensors["offsets"].numel() - 1), "num_tokens": int(tensors["input_ids"].numel()),
        "num_loss_tokens": int(tensors["loss_mask"].sum()),
    }
    atomic_write_bytes(directory / record["file"], payload)
    atomic_write_json(directory / record["file"].replace(".safetensors", ".json"), record)
    return record


def safetensors_layout(tensors: dict[str, tuple[torch.dtype, list[int]]], metadata: dict
                       ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The first bytes `write_shard` writes for tensors of these dtypes and shapes (length prefix and
    header), and each tensor's byte range in the file: the layout without the tensors.

    safetensors orders the data by dtype, then name; that order is read off safetensors itself
    (one-element stand-ins saved with the same names, dtypes and metadata), so a streamed shard
    is byte-identical to `write_shard`'s. The header is compact JSON padded with spaces to 8 bytes."""
    from safetensors.torch import save

    probe = save({name: torch.zeros(1, dtype=dtype) for name, (dtype, _) in tensors.items()},
                 metadata={"eyas": json.dumps(metadata, sort_keys=True)})
    table = json.loads(probe[8:8 + int.from_bytes(probe[:8], "little")])
    relative, cursor = {}, 0
    for name in sorted(tensors, key=lambda name: table[name]["data_offsets"][0]):
        dtype, shape = tensors[name]
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        relative[name] = (cursor, cursor + size)
        table[name].update(shape=list(shape), data_offsets=[cursor, cursor + size])  # keeps safetensors' key order
        cursor += size
    text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    header = len(text).to_bytes(8, "little") + text
    return header, {name: (len(header) + a, len(header) + b) for name, (a, b) in relative.items()}


def _sha256_reading_into(path: Path, block: int = 1 << 22) -> str:
    """A file's SHA-256 read into one reused 4 MB buffer: the host memory it takes stays the same for
    any file size (reading fresh 16 MB blocks holds two at a time, 32 MB)."""
    digest, buffer = hashlib.sha256(), bytearray(block)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


class ShardWriter:
    """Shard `index` written as its batches arrive, so the host holds a batch, never the shard.

    The plan gives every sample's length before the first batch, so once that batch shows the
    tensors' dtypes and row shapes the file's whole layout is known: the header goes first, then
    each batch's rows straight to their offsets in a temporary file (`.NAME.tmp.PID`, sized up
    front), their per-sample CRC-32 taken on the way. `finish` writes the checksums, fsyncs, hashes
    the file once (sha256 in one sequential read: what the sidecar records, and what a rerun of the
    dump trusts from then on), renames it into place and writes the sidecar. The file is
    byte-identical to `write_shard`'s for the same tensors. `write` and `finish` may run on other
    threads than the constructor, one call at a time.
    """

    def __init__(self, directory: Path, index: int, lengths: np.ndarray, sample_index: np.ndarray, metadata: dict):
        self.path = Path(directory) / shard_name(index)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.sample_index = np.asarray(sample_index, dtype=np.int64)
        self.metadata = metadata
        self.crcs = np.zeros(len(self.lengths), dtype=np.int64)
        self.samples = 0  # samples written so far (they arrive in plan order)
        self.loss_tokens = 0
        self.ranges: dict[str, tuple[int, int]] = {}  # tensor -> byte range in the file, once laid out
        self.rows: dict[str, tuple[torch.dtype, list[int], int]] = {}  # per-token tensor -> dtype, row shape, row bytes
        self.size = 0
        self._fd: int | None = None
        self._tmp: Path | None = None

    def write(self, rows: dict[str, torch.Tensor], samples: int) -> None:
        """The next `samples` samples' rows of every per-token tensor (input_ids, loss_mask, features)."""
        start, end = self.samples, self.samples + samples
        first, last = int(self.offsets[start]), int(self.offsets[end])
        try:
            if self._fd is None:
                self._open({name: (t.dtype, list(t.shape[1:])) for name, t in rows.items()})
            self._check(rows, last - first)
            data = {name: rows_bytes(t) for name, t in rows.items()}
            local = self.offsets[start:end + 1] - first
            names = sorted(data)  # the checksum's order: `sample_checksums`
            for s in range(samples):
                crc = 0
                for name in names:
                    crc = zlib.crc32(data[name][local[s]:local[s + 1]], crc)
                self.crcs[start + s] = crc
            for name, block in data.items():
                self._pwrite(block, self.ranges[name][0] + first * self.rows[name][2])
        except OSError as exc:
            self.abort()
            raise _write_error(self.path, exc) from None
        self.loss_tokens += int(rows["loss_mask"].sum())
        self.samples = end

    def finish(self) -> dict:
        """Checksums, fsync, sha256, rename into place, sidecar; returns the sidecar's record."""
        if self._fd is None or self.samples != len(self.lengths):
            self.abort()
            raise EyasError(f"internal error: shard '{self.path}' was given {self.samples} of its "
                            f"{len(self.lengths)} samples; rerun `eyas dump RECIPE`")
        try:
            self._pwrite(self.crcs, self.ranges[CHECKSUM][0])
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            digest = _sha256_reading_into(self._tmp)
            os.replace(self._tmp, self.path)
            self._tmp = None
        except OSError as exc:
            self.abort()
            raise _write_error(self.path, exc) from None
        except BaseException:
            self.abort()
            raise
        _fsync_dir(self.path.parent)
        record = {"file": self.path.name, "bytes": self.size, "sha256": digest, "num_samples": len(self.lengths),
                  "num_tokens": int(self.offsets[-1]), "num_loss_tokens": self.loss_tokens}
        atomic_write_json(self.path.with_suffix(".json"), record)
        return record

    def abort(self) -> None:
        """Drop the unfinished file (an error or interrupt in this process; a killed one's is removed
        by the next single-process dump, `remove_stale_temps`)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def _open(self, per_token: dict[str, tuple[torch.dtype, list[int]]]) -> None:
        n, tokens = len(self.lengths), int(self.offsets[-1])
        tensors = {name: (dtype, [tokens] + shape) for name, (dtype, shape) in per_token.items()}
        tensors.update({"offsets": (torch.int64, [n + 1]), "sample_index": (torch.int64, [n]), CHECKSUM: (torch.int64, [n])})
        header, self.ranges = safetensors_layout(tensors, self.metadata)
        self.rows = {name: (dtype, shape, math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
                     for name, (dtype, shape) in per_token.items()}
        self.size = max([len(header)] + [end for _, end in self.ranges.values()])
        self._tmp = temp_name(self.path)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.ftruncate(self._fd, self.size)  # the final size now: rows land at their offsets in any order
        self._pwrite(header, 0)
        self._pwrite(self.offsets, self.ranges["offsets"][0])
        self._pwrite(self.sample_index, self.ranges["sample_index"][0])

    def _check(self, rows: dict[str, torch.Tensor], tokens: int) -> None:
        """Every batch carries the tensors the first one laid out, with the planned number of rows."""
        for name, t in rows.items():
            if name not in self.rows or (t.dtype, list(t.shape[1:])) != self.rows[name][:2] or t.shape[0] != tokens:
                raise EyasError(f"internal error: a batch for '{self.path}' holds '{name}' {t.dtype} {list(t.shape)}, "
                                f"the shard was laid out for {self.rows.get(name, ('nothing',))[:2]} x {tokens} rows")
        if set(rows) != set(self.rows):
            raise EyasError(f"internal error: a batch for '{self.path}' lacks {sorted(set(self.rows) - set(rows))}")

    def _pwrite(self, buffer: Any, position: int) -> None:
        view = memoryview(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)) if isinstance(buffer, np.ndarray) \
            else memoryview(buffer)
        while len(view):  # a single write moves at most ~2 GB on Linux
            done = os.pwrite(self._fd, view, position)
            view, position = view[done:], position + done


def read_sidecar(directory: Path, index: int) -> dict | None:
    path = directory / shard_name(index).replace(".safetensors", ".json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def check_shard(directory: Path, index: int, full: bool = True, expect_plan: str | None = None,
                recorded: dict | None = None) -> str:
    """'' if shard `index` is complete and intact, else why not (missing, truncated, checksum, foreign).

    `full=False` checks the sidecar, the size and (with `expect_plan`) the header, and trusts the
    bytes: the writer hashed them once, and the reader checks each sample's CRC-32 as it reads.
    `recorded`: the shard's record in an existing manifest; a sidecar that disagrees with it
    (the shard was rewritten since) is checked in full. `expect_plan`: the plan fingerprint of
    the dump being made; a shard written for another plan (copied in from another dump, sidecar
    and all) is not this dump's."""
    record = read_sidecar(directory, index)
    path = directory / shard_name(index)
    if record is None:
        return "missing" if not path.exists() else "no sidecar (interrupted write)"
    if not path.is_file():
        return "missing"
    # what finalize_split indexes and sums: a sidecar lacking it is redone, like one that is unreadable
    if record_problem(record, ("num_samples", "num_tokens", "num_loss_tokens")) or record["file"] != path.name:
        return "a damaged sidecar"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"truncated or resized ({size} bytes, expected {record['bytes']})"
    if recorded is not None and (recorded.get("sha256"), recorded.get("bytes")) != (record["sha256"], record["bytes"]):
        full = True
    if expect_plan is not None:
        try:
            problem = header_problem(read_header(path), index, expect_plan, record)
        except (OSError, ValueError) as exc:
            problem = f"a damaged file ({exc})"
        if problem:
            return problem
    if full and sha256_file(path) != record["sha256"]:
        return "checksum mismatch (corrupt)"
    return ""


def build_index(directory: Path, records: list[dict]) -> dict:
    """index.safetensors from the shards' offsets; returns its manifest record."""
    from safetensors import safe_open
    from safetensors.torch import save

    lengths, shards, rows, prepared = [], [], [], []
    for shard_i, record in enumerate(records):
        with safe_open(str(directory / record["file"]), "pt") as f:
            offsets = f.get_tensor("offsets")
            sample_index = f.get_tensor("sample_index")
        n = offsets.numel() - 1
        lengths.append((offsets[1:] - offsets[:-1]).to(torch.int32))
        shards.append(torch.full((n,), shard_i, dtype=torch.int32))
        rows.append(torch.arange(n, dtype=torch.int32))
        prepared.append(sample_index.to(torch.int64))
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    tensors = {"length": cat(lengths, torch.int32), "shard": cat(shards, torch.int32),
               "row": cat(rows, torch.int32), "prepared_index": cat(prepared, torch.int64)}
    payload = save(tensors)
    atomic_write_bytes(directory / INDEX, payload)
    return {"file": INDEX, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}


def wait_for(paths: list[Path], poll_s: float = 2.0, timeout_s: float | None = None) -> None:
    """Block until every path exists (rank 0 waiting for the other ranks' shards)."""
    start = time.monotonic()
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise EyasError(f"gave up waiting for {len(missing)} shard(s) from other ranks, e.g. '{missing[0]}'")
        time.sleep(poll_s)
