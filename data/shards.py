"""Hidden-state shards on disk: encodings, the atomic writer and the lazy reader.

The training loader (token-budget batches, read-ahead workers, decoding on the device) is
`eyas.train.loader`; it reads samples as stored through `ShardReader.codes`.

Layout of a shard directory (written by `eyas dump`):

    manifest.json           schema version, target identity, layers, encodings, counts, and
                            per shard: file, bytes, sha256. Written last: no manifest, no dump.
    index.safetensors       per sample: `length`, `shard`, `row` (position in its shard),
                            `prepared_index` (row of the prepared dataset). Memory-mapped, so
                            opening a dump costs the same for 1,000 or 10,000,000 samples.
    shard-00000.safetensors samples packed back to back (no padding):
                            `offsets` int64 [n+1], `sample_index` int64 [n] (prepared rows),
                            `input_ids` [N] (uint16 when the vocabulary fits, else int32),
                            `loss_mask` uint8 [N], features per token (below).
                            `sample_crc32` int64 [n] (CRC-32 of each sample's bytes, below).
    shard-00000.json        the shard's sidecar (sha256, bytes, counts): a shard is done when both
                            files exist and agree; a killed writer leaves neither (temp + rename).

Each shard's safetensors metadata holds the fingerprint of the dump plan it was written for
(target identity, data, settings; also in the manifest as `plan`) and its own shard number.
`eyas dump` writes a shard as its batches arrive (`ShardWriter`: header first, rows at their
offsets), so its host memory does not grow with the shard; the bytes equal `write_shard`'s.

What a reader verifies, and when (`ShardReader`, on by default; `eyas verify` checks everything):
- at open, for every shard: that it exists with its recorded size, and its header (one small
  read): the plan fingerprint and shard number (a shard copied in from another dump, even of a
  target with the same shapes, is refused here), the sample and token counts. The small index
  is hashed against the manifest as it is read;
- the first time a process reads from a shard: `offsets` and `sample_index` against the index;
- the first time a process reads a sample: the CRC-32 of exactly the bytes read (every per-token
  tensor's rows) against `sample_crc32`. So a corrupt byte stops training at the batch that
  would read it, and the cost is proportional to what is read (the time to first batch stays
  flat). Shards written before `sample_crc32` existed are hashed whole (sha256) at first read.

Features (per token; `<name>` holds the codes, `<name>.scale` the scales when encoded):
    aux_hidden.0/.1/.2      EAGLE-3's fused layers (HF hidden_states indices in manifest `layers`)
    last_hidden             HF hidden_states[-1] (after the final norm: the lm_head input)
    topk_values, topk_ids   teacher top-k log-probabilities (fp16) and ids, when dumped

Encodings: bf16, fp16; fp8 (e4m3) and int8 with one bf16 scale per token and layer
(scale = absmax / 448 or / 127); int4 in groups of 32 values with one bf16 scale per group.
Error bounds (per element, x the original value, a the token's absmax over the layer):
int8 |err| <= a/252; fp8 |err| <= |x|/16 + a/448 * 2^-9; int4 |err| <= a_group/13.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import zlib
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.config import load_recipe
from eyas.errors import EyasError
from eyas.io import _fsync_dir, _write_error, atomic_write_bytes, atomic_write_json, json_problem, sha256_file, temp_name
from eyas.stage_cli import guarded, stage_parser
from eyas.targets import load_target_config, load_tokenizer, target_identity

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.safetensors"
ENCODINGS = ("bf16", "fp16", "fp8", "int8", "int4")
INT4_GROUP = 32
FP8_MAX = 448.0
OPEN_HANDLES = 64  # safetensors handles kept open by a reader (least recently used are closed)
CHECKSUM = "sample_crc32"  # per sample: CRC-32 over its rows of every per-token tensor (sorted by name)
NOT_PER_TOKEN = ("offsets", "sample_index", CHECKSUM)
MAX_HEADER = 100 << 20  # safetensors' own limit on a header


# ----------------------------------------------------------------------------- encodings


def _token_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-row scale absmax / qmax, rounded to bf16 (what is stored is what is used)."""
    absmax = x.abs().amax(dim=-1, keepdim=True).float()
    # Rounding to bf16 moves a value by at most 2^-9; scaling up by 2^-8 first keeps the
    # stored scale >= absmax / qmax, so the largest value never clips.
    scale = (absmax / qmax * (1 + 2.0**-8)).to(torch.bfloat16)
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.where(scale > 0, scale, torch.full_like(scale, tiny))


def encode(x: torch.Tensor, encoding: str) -> dict[str, torch.Tensor]:
    """Encode a [N, D] float tensor; returns {"": codes} plus {".scale": scales} where used."""
    if encoding == "bf16":
        return {"": x.to(torch.bfloat16)}
    if encoding == "fp16":
        return {"": x.to(torch.float16)}
    if encoding == "int8":
        scale = _token_scale(x, 127.0)
        codes = torch.round(x.float() / scale.float()).clamp_(-127, 127).to(torch.int8)
        return {"": codes, ".scale": scale}
    if encoding == "fp8":
        scale = _token_scale(x, FP8_MAX)
        codes = (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"": codes, ".scale": scale}
    if encoding == "int4":
        n, d = x.shape
        if d % INT4_GROUP:
            raise EyasError(f"dump encoding int4 needs a hidden size divisible by {INT4_GROUP}, got {d}; use int8")
        groups = x.float().reshape(n, d // INT4_GROUP, INT4_GROUP)
        scale = _token_scale(groups, 7.0)  # [n, d/g, 1]
        codes = (torch.round(groups / scale.float()).clamp_(-7, 7) + 8).to(torch.uint8).reshape(n, d)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # two 4-bit codes per byte
        return {"": packed, ".scale": scale.reshape(n, d // INT4_GROUP)}
    raise EyasError(f"unknown shard encoding '{encoding}'; choose one of: {', '.join(ENCODINGS)}")


def decode(codes: torch.Tensor, scale: torch.Tensor | None, encoding: str, dtype=torch.float32) -> torch.Tensor:
    """Inverse of `encode` (up to the encoding's error) as `dtype`."""
    if encoding in ("bf16", "fp16"):
        return codes.to(dtype)
    if encoding in ("int8", "fp8"):
        return (codes.float() * scale.float()).to(dtype)
    if encoding == "int4":
        n, half = codes.shape
        low = (codes & 0xF).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=-1).reshape(n, half * 2).float()
        groups = values.reshape(n, -1, INT4_GROUP) * scale.float().unsqueeze(-1)
        return groups.reshape(n, half * 2).to(dtype)
    raise EyasError(f"unknown shard encoding '{encoding}'; choose one of: {', '.join(ENCODINGS)}")


def ids_dtype(vocab_size: int) -> torch.dtype:
    """Token ids on disk: 2 bytes when the vocabulary fits (SmolLM2, Llama-2), else 4."""
    return torch.uint16 if vocab_size <= 65536 else torch.int32


# ----------------------------------------------------------------------------- writing



def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _rows_bytes(t: torch.Tensor) -> np.ndarray:
    """A per-token tensor as bytes, one row per token ([N, bytes per token], uint8)."""
    t = t.contiguous()
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
    return flat.view(torch.uint8).numpy()


def sample_checksums(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """CRC-32 per sample over its rows of every per-token tensor, in name order (int64 [n])."""
    offsets = tensors["offsets"].tolist()
    rows = [_rows_bytes(tensors[name]) for name in sorted(tensors) if name not in NOT_PER_TOKEN]
    sums = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        crc = 0
        for r in rows:
            crc = zlib.crc32(r[start:end], crc)
        sums.append(crc)
    return torch.tensor(sums, dtype=torch.int64)


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
            data = {name: _rows_bytes(t) for name, t in rows.items()}
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


def read_header(path: Path) -> dict:
    """The safetensors header of a file (tensor table and `__metadata__`): one small read.

    ValueError says what is wrong with it."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        size = os.fstat(f.fileno()).st_size
        if n > MAX_HEADER or n + 8 > size:
            raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"header is not valid JSON ({json_problem(exc)})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def shard_metadata(header: dict) -> dict:
    """The eyas metadata a shard header carries ({} when there is none)."""
    metadata = header.get("__metadata__") or {}
    raw = metadata.get("eyas") if isinstance(metadata, dict) else None
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        raise ValueError("its eyas metadata is not valid JSON") from None
    return meta if isinstance(meta, dict) else {}


def header_problem(header: dict, index: int, expect_plan: str | None, record: dict | None = None) -> str:
    """'' if a shard header fits this dump (plan fingerprint, shard number, counts), else what differs."""
    try:
        meta = shard_metadata(header)
    except ValueError as exc:
        return f"a damaged file ({exc})"
    plan = meta.get("plan")
    if expect_plan is not None and plan != expect_plan:
        return (f"from another dump (its plan fingerprint is {plan}, this dump's is {expect_plan}: "
                "another target, other data or other settings)")
    if "shard" in meta and meta["shard"] != index:
        return f"shard {meta['shard']} of its dump, not shard {index}"
    if record is not None:
        expected = {"offsets": [record.get("num_samples", -2) + 1], "input_ids": [record.get("num_tokens")]}
        for name, shape in expected.items():
            if shape[0] is None or shape[0] < 0:
                continue
            entry = header.get(name)
            if not isinstance(entry, dict) or entry.get("shape") != shape:
                got = entry.get("shape") if isinstance(entry, dict) else "nothing"
                return f"a damaged file ({name} has shape {got}, the manifest says {shape})"
    return ""


def expected_plan(shard_dir: Path, manifest: dict | None = None) -> str | None:
    """The plan fingerprint every shard of a dump carries: the manifest's, else plan.json's."""
    if manifest is not None and manifest.get("plan"):
        return manifest["plan"]
    try:
        return json.loads((Path(shard_dir) / "plan.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def file_problems(shard_dir: Path, manifest: dict) -> list[tuple[Path, str]]:
    """(path, what is wrong) for each file of a dump that is missing, resized or not of this dump.

    Reads one small header per shard; `verify` adds the full checksums."""
    shard_dir = Path(shard_dir)
    plan = expected_plan(shard_dir, manifest)
    headers: dict[int, dict] = {}
    problems = file_problems_sizes(shard_dir, manifest)
    flagged = {path for path, _ in problems}
    for i, record in enumerate(manifest["shards"]):
        path = shard_dir / record["file"]
        if path in flagged:
            continue
        try:
            headers[i] = read_header(path)
        except (OSError, ValueError) as exc:
            problems.append((path, f"a damaged file ({exc})"))
    if plan is None and headers:  # a dump without a recorded plan: every shard must carry the same one
        plan = Counter(_plan_of(h) for h in headers.values()).most_common(1)[0][0]
    for i, header in headers.items():
        problem = header_problem(header, i, plan, manifest["shards"][i])
        if problem:
            problems.append((shard_dir / manifest["shards"][i]["file"], problem))
    return problems


def _plan_of(header: dict) -> str | None:
    try:
        return shard_metadata(header).get("plan")
    except ValueError:
        return None


def file_problems_sizes(shard_dir: Path, manifest: dict) -> list[tuple[Path, str]]:
    """Existence and size of every file of a dump (all a reader checks with verify=False)."""
    problems = []
    for record in manifest["shards"] + [manifest["index"]]:
        path = Path(shard_dir) / record["file"]
        if not path.is_file():
            problems.append((path, "missing"))
        elif path.stat().st_size != record["bytes"]:
            problems.append((path, f"truncated or altered ({path.stat().st_size} bytes, "
                                   f"the manifest says {record['bytes']})"))
    return problems


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


def verify(shard_dir: str | Path) -> list[str]:
    """Full check of a dump: every file's size, header and sha256 against the manifest, and the
    shards' offsets against the index. Returns problems, one per file."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    found = file_problems(shard_dir, manifest)
    problems = [f"{path}: {problem}" for path, problem in found]
    flagged = {path for path, _ in found}
    for record in manifest["shards"] + [manifest["index"]]:
        path = shard_dir / record["file"]
        if path not in flagged and sha256_file(path) != record["sha256"]:
            problems.append(f"{path}: checksum mismatch (corrupt)")
            flagged.add(path)
    if shard_dir / INDEX not in flagged:
        reader = ShardReader(shard_dir, check_files=False)
        for i, record in enumerate(manifest["shards"]):
            path = shard_dir / record["file"]
            problem = "" if path in flagged else reader.shard_problem(i)
            if problem:
                problems.append(f"{path}: {problem}")
    return problems


# ----------------------------------------------------------------------------- reading


def read_manifest(shard_dir: Path) -> dict:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise EyasError(f"no shards at '{shard_dir}' ({MANIFEST} is missing); run `eyas dump RECIPE` first")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:
        raise EyasError(f"'{path}' is not valid JSON ({json_problem(exc)}); rerun `eyas dump RECIPE` to rewrite it") from None
    if not isinstance(manifest, dict):
        raise EyasError(f"'{path}' holds a JSON {type(manifest).__name__}, not a manifest; rerun `eyas dump RECIPE` to rewrite it")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise EyasError(
            f"'{path}' has shard schema version {manifest.get('schema_version')!r}, this eyas reads version "
            f"{SCHEMA_VERSION}; dump again with this version (`eyas dump RECIPE`)"
        )
    problem = manifest_problem(manifest)
    if problem:
        raise EyasError(f"'{path}' is damaged ({problem}); rerun `eyas dump RECIPE` to rewrite it")
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def record_problem(record: Any, counts: tuple[str, ...] = ()) -> str:
    """'' if a file record (a manifest's shard or index entry, a sidecar) has what readers use, else what is wrong:
    a plain file name inside the dump's folder, its size, its sha256 and the given counts."""
    if not isinstance(record, dict):
        return f"a file record is a JSON {type(record).__name__}"
    name = record.get("file")
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\x00"):
        return f"file {name!r} is not a file name in the dump's folder"
    for key in ("bytes", *counts):
        if not _count(record.get(key)):
            return f"'{key}' of {name!r} is {record.get(key)!r}, not a count"
    if not isinstance(record.get("sha256"), str):
        return f"'sha256' of {name!r} is {record.get('sha256')!r}, not a digest"
    return ""


def manifest_problem(manifest: dict) -> str:
    """'' if a manifest has the shape the reader and the trainer rely on, else what is wrong with it."""
    if not isinstance(manifest.get("target_identity"), str):
        return f"'target_identity' is {manifest.get('target_identity')!r}"
    if not _count(manifest.get("hidden_size")):
        return f"'hidden_size' is {manifest.get('hidden_size')!r}"
    if not isinstance(manifest.get("layers", []), list) or not all(_count(i) for i in manifest.get("layers", [])):
        return f"'layers' is {manifest.get('layers')!r}, not a list of layer indices"
    if not isinstance(manifest.get("plan", ""), str):
        return f"'plan' is {manifest.get('plan')!r}"
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return f"'shards' is {type(shards).__name__}, not a list"
    for record in shards:
        problem = record_problem(record, ("num_samples", "num_tokens"))
        if problem:
            return problem
    problem = record_problem(manifest.get("index"))
    return f"index: {problem}" if problem else features_problem(manifest.get("features"))


def features_problem(features: Any) -> str:
    """'' if a manifest's `features` names known encodings with consistent shapes, else what is wrong."""
    if not isinstance(features, dict):
        return f"'features' is {type(features).__name__}, not a mapping"
    for name, entry in features.items():
        if not isinstance(entry, dict) or not (isinstance(entry.get("shape"), list) and len(entry["shape"]) == 1
                                               and _count(entry["shape"][0])):
            return f"feature {name!r} has no shape [width]"
    aux, last = features.get("aux_hidden"), features.get("last_hidden")
    if aux is not None:
        encodings, layers = aux.get("encodings"), aux.get("layers")
        if not (isinstance(encodings, list) and isinstance(layers, list) and encodings and len(encodings) == len(layers)
                and all(e in ENCODINGS for e in encodings) and all(_count(i) for i in layers)):
            return f"aux_hidden's encodings {encodings!r} and layers {layers!r} do not match"
    if last is not None and last.get("encoding") not in ENCODINGS:
        return f"last_hidden's encoding is {last.get('encoding')!r}"
    if ("topk_values" in features) != ("topk_ids" in features):
        return "the teacher top-k has values or ids, not both"
    return ""


SCALED = ("int8", "fp8", "int4")  # encodings stored with a `<name>.scale` tensor beside the codes
STORED_DTYPE = {"bf16": "BF16", "fp16": "F16", "fp8": "F8_E4M3", "int8": "I8", "int4": "U8"}  # safetensors' names


def feature_parts(features: dict) -> dict[str, list[tuple[str, str]]]:
    """Each decoded feature's stored tensors and their encodings, in concatenation order (manifest `features`):
    {"aux_hidden": [("aux_hidden.0", "fp8"), ...], "last_hidden": [("last_hidden", "fp8")]}."""
    parts = {}
    if "aux_hidden" in features:
        parts["aux_hidden"] = [(f"aux_hidden.{j}", enc) for j, enc in enumerate(features["aux_hidden"]["encodings"])]
    if "last_hidden" in features:
        parts["last_hidden"] = [("last_hidden", features["last_hidden"]["encoding"])]
    return parts


def stored_names(features: dict) -> list[str]:
    """The tensors a sample is read from: ids, loss mask, each feature's codes (and scales), teacher top-k."""
    names = ["input_ids", "loss_mask"]
    for parts in feature_parts(features).values():
        for name, encoding in parts:
            names += [name, name + ".scale"] if encoding in SCALED else [name]
    if "topk_values" in features:
        names += ["topk_values", "topk_ids"]
    return names


def stored_layout(features: dict, tokens: int) -> dict[str, tuple[str | None, list[int]]]:
    """Each per-token tensor a shard of `tokens` tokens holds for these manifest features: (safetensors dtype, or
    None where more than one is written, shape). A feature's width is split evenly over its parts (aux_hidden's
    layers); int4 packs two codes a byte, with one scale per group of INT4_GROUP values."""
    layout: dict[str, tuple[str | None, list[int]]] = {"input_ids": (None, [tokens]), "loss_mask": ("U8", [tokens])}
    for feature, parts in feature_parts(features).items():
        width = features[feature]["shape"][0] // len(parts)
        for name, encoding in parts:
            layout[name] = (STORED_DTYPE[encoding], [tokens, width // 2 if encoding == "int4" else width])
            if encoding in SCALED:
                layout[name + ".scale"] = ("BF16", [tokens, width // INT4_GROUP if encoding == "int4" else 1])
    if "topk_values" in features:
        k = features["topk_values"]["shape"][0]
        layout.update(topk_values=("F16", [tokens, k]), topk_ids=(None, [tokens, k]))
    return layout


def decode_sample(stored: dict[str, torch.Tensor], features: dict, dtype: torch.dtype = torch.float32
                  ) -> dict[str, torch.Tensor]:
    """What the trainer reads, from what is stored: input_ids long, loss_mask float, features as `dtype`
    (aux_hidden's layers concatenated), top-k values float and ids long.

    Tensors are [T, ...] (one sample) or [N, ...] (a padded batch flattened); it runs on whatever
    device they are on: the CPU in `ShardReader.sample`, the training device in the loader."""
    out = {"input_ids": stored["input_ids"].long(), "loss_mask": stored["loss_mask"].to(torch.float32)}
    for feature, parts in feature_parts(features).items():
        decoded = [decode(stored[name], stored[name + ".scale"] if encoding in SCALED else None, encoding, dtype)
                   for name, encoding in parts]
        out[feature] = torch.cat(decoded, dim=-1) if feature == "aux_hidden" else decoded[0]
    if "topk_values" in features:
        out["topk_values"] = stored["topk_values"].to(torch.float32)
        out["topk_ids"] = stored["topk_ids"].long()
    return out


class ShardReader:
    """Random access to the samples of a dump: lazy, memory-mapped, validated on open and on read.

    Opening reads manifest.json and the small index (hashed against the manifest as it is read),
    and checks every shard's size and header (one small read per shard: plan fingerprint, shard
    number, counts; see the module docstring). Shard files are opened with safetensors'
    `safe_open` the first time a sample needs them; then their offsets are checked against the
    index, and each sample's bytes against its CRC-32 the first time this process reads it.
    `expect_identity`: the target identity the caller trains for; shards of another target or
    tokenizer are refused with the reason. `verify=False` keeps only the size checks (benchmarks).
    """

    def __init__(self, shard_dir: str | Path, expect_identity: str | None = None, dtype: torch.dtype = torch.float32,
                 verify: bool = True, check_files: bool = True):
        self.shard_dir = Path(shard_dir)
        self.manifest = read_manifest(self.shard_dir)
        self.dtype = dtype
        self.verify = bool(verify)
        if expect_identity is not None and self.manifest["target_identity"] != expect_identity:
            older = ("; it was dumped by an older eyas whose target identity included the target's folder"
                     if "identity_scheme" not in self.manifest else "")
            raise EyasError(
                f"the shards in '{self.shard_dir}' were dumped from another target or tokenizer "
                f"(identity {self.manifest['target_identity']}, target '{self.manifest.get('target_path')}'), "
                f"not the one this run uses (identity {expect_identity}){older}; dump again for this target"
            )
        if check_files:
            self._check_files()
        self._index = self._load_index()
        records = self.manifest["shards"]
        counts = [r.get("num_samples") for r in records]
        self._starts = np.cumsum([0] + counts) if all(isinstance(c, int) for c in counts) else None
        self._check_index(counts)
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._offsets: dict[int, torch.Tensor] = {}
        self._reset_verification()

    def _reset_verification(self) -> None:
        self._checked: dict[int, tuple[list[str], torch.Tensor | None]] = {}  # shard -> (row tensors, crcs)
        self._sample_ok = np.zeros(len(self._index["length"]), dtype=bool)

    # -- opening
    def _check_files(self) -> None:
        found = (file_problems if self.verify else file_problems_sizes)(self.shard_dir, self.manifest)
        if found:
            problems = [f"'{path}' is {problem}" for path, problem in found]
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise EyasError(f"{len(problems)} shard file(s) are missing or damaged: {'; '.join(problems[:5])}{more}; "
                            "rerun `eyas dump RECIPE` to repair them")

    def _load_index(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        path = self.shard_dir / INDEX
        try:
            payload = path.read_bytes()
        except OSError as exc:
            raise EyasError(f"shard index '{path}' cannot be read ({exc.strerror or exc}); "
                            "rerun `eyas dump RECIPE`") from None
        expected = self.manifest.get("index", {}).get("sha256")
        if self.verify and expected and hashlib.sha256(payload).hexdigest() != expected:
            raise EyasError(f"shard index '{path}' does not match its checksum in the manifest (corrupt); "
                            "rerun `eyas dump RECIPE` to repair it")
        try:
            index = load(payload)
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise EyasError(f"shard index '{path}' cannot be read ({exc}); rerun `eyas dump RECIPE`") from None
        columns = ("length", "shard", "row", "prepared_index")
        if any(name not in index or index[name].dim() != 1 for name in columns) or \
                len({index[name].numel() for name in columns}) != 1:
            raise EyasError(f"shard index '{path}' lacks its columns ({', '.join(columns)}, one value per sample); "
                            "rerun `eyas dump RECIPE` to repair it")
        return index

    def _check_index(self, counts: list[int]) -> None:
        """The index lists exactly the manifest's samples, each at a shard and row the manifest has (a manifest
        that lost a shard's record still matches its index's checksum)."""
        shard, row = self._index["shard"].long(), self._index["row"].long()
        n, last = int(shard.numel()), len(counts) - 1
        fits = n == sum(counts) and (n == 0 or (int(shard.min()) >= 0 and int(shard.max()) <= last and int(row.min()) >= 0
                                               and bool((row < torch.tensor(counts)[shard.clamp(0, last)]).all())))
        if not fits:
            raise EyasError(f"the shard index of '{self.shard_dir}' lists {n} samples, its manifest {sum(counts)} in "
                            f"{len(counts)} shards: they are not of one dump; rerun `eyas dump RECIPE` to rewrite them")

    def _handle(self, shard: int):
        from safetensors import safe_open

        if shard in self._handles:
            self._handles.move_to_end(shard)
            return self._handles[shard]
        path = self.shard_dir / self.manifest["shards"][shard]["file"]
        try:
            handle = safe_open(str(path), "pt")
            offsets = handle.get_tensor("offsets")
        except Exception as exc:
            raise EyasError(f"shard file '{path}' cannot be read ({exc}); rerun `eyas dump RECIPE` to repair it") from None
        if self.verify and shard not in self._checked:
            problem = self._shard_problem(shard, handle, offsets)
            if problem:
                raise EyasError(f"shard file '{path}' is corrupt: {problem}; rerun `eyas dump RECIPE` with --reverify to repair it")
        self._offsets[shard] = offsets
        self._handles[shard] = handle
        if len(self._handles) > OPEN_HANDLES:
            old, _ = self._handles.popitem(last=False)
            self._offsets.pop(old, None)
        return handle

    def shard_problem(self, shard: int) -> str:
        """'' if shard `shard` passes the first-read checks (offsets, sample_index, checksums), else why not."""
        from safetensors import safe_open

        try:
            handle = safe_open(str(self.shard_dir / self.manifest["shards"][shard]["file"]), "pt")
            return self._shard_problem(shard, handle, handle.get_tensor("offsets"))
        except Exception as exc:
            return f"cannot be read ({exc})"

    def _shard_problem(self, shard: int, handle: Any, offsets: torch.Tensor) -> str:
        """First read of a shard in this process: offsets and sample_index against the index, and
        the per-sample checksums loaded (or, for a shard without them, the whole file hashed)."""
        record = self.manifest["shards"][shard]
        keys = set(handle.keys())
        problem = self._layout_problem(handle, keys, record["num_tokens"])
        if problem:
            return problem
        n = int(offsets.numel()) - 1
        if self._starts is not None:
            start, end = int(self._starts[shard]), int(self._starts[shard + 1])
            if n != end - start:
                return f"its offsets hold {n} samples, the manifest says {end - start}"
            if offsets.dtype != torch.int64 or (n >= 0 and int(offsets[0]) != 0):
                return "its offsets do not start at 0"
            lengths = (offsets[1:] - offsets[:-1]).numpy()
            bad = np.nonzero(lengths != self._index["length"][start:end].numpy())[0]
            if bad.size:
                return f"its offsets give sample {int(bad[0])} {int(lengths[bad[0]])} tokens, the index says " \
                       f"{int(self._index['length'][start + int(bad[0])])}"
            if n and int(offsets[-1]) != record.get("num_tokens", int(offsets[-1])):
                return f"its offsets end at {int(offsets[-1])}, the shard holds {record.get('num_tokens')} tokens"
            if not torch.equal(handle.get_tensor("sample_index").to(torch.int64),
                               self._index["prepared_index"][start:end]):
                return "its sample_index differs from the index"
        rows = sorted(k for k in keys if k not in NOT_PER_TOKEN)
        crcs = None
        if CHECKSUM in keys:
            crcs = handle.get_tensor(CHECKSUM)
            if crcs.numel() != n:
                return f"it holds {crcs.numel()} sample checksums for {n} samples"
        else:  # written before per-sample checksums: hash the whole file once
            path = self.shard_dir / record["file"]
            if sha256_file(path) != record["sha256"]:
                return "its sha256 differs from the manifest's"
        self._checked[shard] = (rows, crcs)
        return ""

    def _layout_problem(self, handle: Any, keys: set[str], tokens: int) -> str:
        """'' if a shard holds every tensor the manifest's features name, in the dtype its encoding stores and the
        shape decoding expects ([tokens, width]), else what differs (a header edited to another valid layout)."""
        names = stored_names(self.manifest["features"]) + ["offsets", "sample_index"]
        missing = [name for name in names if name not in keys]
        if missing:
            return f"it lacks '{missing[0]}', which the manifest's features name"
        for name, (dtype, shape) in stored_layout(self.manifest["features"], tokens).items():
            found = handle.get_slice(name)
            if dtype is not None and found.get_dtype() != dtype:
                return f"its '{name}' is {found.get_dtype()}, the manifest's encoding stores {dtype}"
            if list(found.get_shape()) != shape:
                return f"its '{name}' has shape {list(found.get_shape())}, the manifest's features give {shape}"
        return ""

    def __getstate__(self):  # DataLoader workers re-open (and re-check) files lazily in their own process
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"], state["_checked"] = OrderedDict(), {}, {}
        state["_sample_ok"] = np.zeros_like(self._sample_ok)
        return state

    # -- access
    def __len__(self) -> int:
        return int(self._index["length"].numel())

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (int32 numpy view of the index)."""
        return self._index["length"].numpy()

    @property
    def features(self) -> list[str]:
        """Feature names as batches carry them: aux_hidden, last_hidden, topk_values, topk_ids."""
        return list(self.manifest["features"])

    def prepared_index(self, i: int) -> int:
        return int(self._index["prepared_index"][i])

    def shard_offsets(self, shard: int) -> torch.Tensor:
        """Token offsets of the samples of shard `shard` (opens, and on first use checks, the shard)."""
        self._handle(shard)
        return self._offsets[shard]

    def _read(self, handle, name: str, start: int, end: int) -> torch.Tensor:
        return handle.get_slice(name)[start:end]

    def _check_sample(self, i: int, shard: int, row: int, raw: dict[str, torch.Tensor]) -> None:
        rows, crcs = self._checked[shard]
        if crcs is not None:
            crc = 0
            for name in rows:
                crc = zlib.crc32(_rows_bytes(raw[name]), crc)
            if crc != int(crcs[row]):
                path = self.shard_dir / self.manifest["shards"][shard]["file"]
                raise EyasError(f"shard file '{path}' is corrupt: sample {row} (prepared row {self.prepared_index(i)}) "
                                "does not match its checksum; rerun `eyas dump RECIPE` with --reverify to repair it")
        self._sample_ok[i] = True

    def codes(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i as stored ([T, ...] each, `stored_names`): ids, loss mask, feature codes and scales.

        Checked like `sample` (its checksum at the first read); nothing is decoded, so a loader
        worker only slices the memory-mapped shard and the decode runs on the training device."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
        shard, row = int(self._index["shard"][i]), int(self._index["row"][i])
        handle = self._handle(shard)
        offsets = self._offsets[shard]
        start, end = int(offsets[row]), int(offsets[row + 1])
        raw: dict[str, torch.Tensor] = {}

        def read(name: str) -> torch.Tensor:
            if name not in raw:
                raw[name] = self._read(handle, name, start, end)
            return raw[name]

        if self.verify and not self._sample_ok[i]:
            for name in self._checked[shard][0]:
                read(name)
            self._check_sample(i, shard, row, raw)
        return {name: read(name) for name in stored_names(self.manifest["features"])}

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i: input_ids long [T], loss_mask float [T], decoded features [T, ...] (on the CPU)."""
        return decode_sample(self.codes(i), self.manifest["features"], self.dtype)



# ----------------------------------------------------------------------------- batching
# The dump's batching rule; the trainer's loader (eyas.train.loader) cuts its batches with it too.


def budget_batches(order: np.ndarray, lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Greedy batches over `order` (already sorted longest first): padded size <= token_budget.

    A sample longer than the budget forms a batch of its own.
    """
    batches, start, longest = [], 0, 0
    for pos in range(len(order)):
        length = int(lengths[order[pos]])
        new_longest = max(longest, length)
        if pos > start and new_longest * (pos - start + 1) > token_budget:
            batches.append(order[start:pos])
            start, new_longest = pos, length
        longest = new_longest
    if start < len(order):
        batches.append(order[start:])
    return batches


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


# ----------------------------------------------------------------------------- `eyas verify`


def main(argv: list[str] | None = None) -> int:
    """`eyas verify RUN_DIR_OR_RECIPE`: the full check of a run's shards (every byte hashed)."""
    parser = stage_parser("eyas verify", "check a run's shards in full: sizes, headers, sha256, offsets")
    args = parser.parse_args(argv)

    def body() -> int:
        where = Path(args.recipe)
        identity = None
        if where.is_dir():
            if args.overrides:
                raise EyasError("overrides (section.key=value) need a recipe file; "
                                "give the recipe instead of the folder")
            root = where / "shards" if (where / "shards" / MANIFEST).is_file() else where
        else:
            recipe = load_recipe(where, args.overrides)
            root = recipe.run_dir / "shards"
            if (root / MANIFEST).is_file():
                config = load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
                identity = target_identity(config, load_tokenizer(recipe.target))
        dirs = [d for d in (root, root / "heldout") if (d / MANIFEST).is_file()]
        if not dirs:
            raise EyasError(f"no shards at '{root}' ({MANIFEST} is missing); run `eyas dump RECIPE` first")
        problems: list[str] = []
        for d in dirs:
            started = time.perf_counter()
            manifest = read_manifest(d)
            found = verify(d)
            if identity is not None and manifest.get("target_identity") != identity:
                found.insert(0, f"{d}: dumped from another target or tokenizer (identity "
                                f"{manifest.get('target_identity')}, the recipe's target has {identity})")
            for line in found:
                print(f"eyas verify: {line}", flush=True)
            if not found:
                size = sum(r["bytes"] for r in manifest["shards"]) + manifest["index"]["bytes"]
                print(f"eyas verify: {d}: {len(manifest['shards'])} shards, {size / 1e6:.1f} MB, sizes, headers, "
                      f"checksums and offsets all match ({time.perf_counter() - started:.1f} s)", flush=True)
            problems += found
        if problems:
            raise EyasError(f"{len(problems)} problem(s) in the shards under '{root}' (listed above); "
                            "rerun `eyas dump RECIPE` with --reverify to repair them")
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
