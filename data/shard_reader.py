"""Reading a dump: `ShardReader`, random access to its samples, lazy, memory-mapped, validated on
open and on read. The format it reads is `eyas.data.shard_format`'s.

The training loader (token-budget batches, read-ahead workers, decoding on the device) is
`eyas.train.loader`; it reads samples as stored through `ShardReader.codes`.

What a reader verifies, and when (`ShardReader`, on by default; `eyas verify`,
`eyas.data.shard_verify`, checks everything):
- at open, for every shard: that it exists with its recorded size, and its header (one small
  read): the plan fingerprint and shard number (a shard copied in from another dump, even of a
  target with the same shapes, is refused here), the sample and token counts. The small index
  is hashed against the manifest as it is read;
- the first time a process reads from a shard: `offsets` and `sample_index` against the index;
- the first time a process reads a sample: the CRC-32 of exactly the bytes read (every per-token
  tensor's rows) against `sample_crc32`. So a corrupt byte stops training at the batch that
  would read it, and the cost is proportional to what is read (the time to first batch stays
  flat). Shards written before `sample_crc32` existed are hashed whole (sha256) at first read.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.shard_format import (
    CHECKSUM,
    INDEX,
    NOT_PER_TOKEN,
    decode_sample,
    header_problem,
    read_header,
    read_manifest,
    rows_bytes,
    shard_metadata,
    stored_layout,
    stored_names,
)
from eyas.errors import EyasError
from eyas.io import sha256_file

OPEN_HANDLES = 64  # safetensors handles kept open by a reader (least recently used are closed)


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
                crc = zlib.crc32(rows_bytes(raw[name]), crc)
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
