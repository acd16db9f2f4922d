"""Hidden-state shards on disk: encodings, the atomic writer, the lazy reader and the loader.

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
import os
import sys
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.cli import guarded, stage_parser
from eyas.config import load_recipe
from eyas.errors import EyasError
from eyas.io import atomic_write_bytes, atomic_write_json, sha256_file
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
    except ValueError as exc:
        raise ValueError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def shard_metadata(header: dict) -> dict:
    """The eyas metadata a shard header carries ({} when there is none)."""
    raw = (header.get("__metadata__") or {}).get("eyas")
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
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
    except (OSError, ValueError):
        return None


def check_shard(directory: Path, index: int, full: bool = True, expect_plan: str | None = None) -> str:
    """'' if shard `index` is complete and intact, else why not (missing, truncated, checksum, foreign).

    `expect_plan`: the plan fingerprint of the dump being made; a shard written for another plan
    (copied in from another dump, sidecar and all) is not this dump's."""
    record = read_sidecar(directory, index)
    path = directory / shard_name(index)
    if record is None:
        return "missing" if not path.exists() else "no sidecar (interrupted write)"
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"truncated or resized ({size} bytes, expected {record['bytes']})"
    if expect_plan is not None:
        try:
            problem = header_problem(read_header(path), index, expect_plan)
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
    except ValueError as exc:
        raise EyasError(f"'{path}' is not valid JSON ({exc}); rerun `eyas dump RECIPE` to rewrite it") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise EyasError(
            f"'{path}' has shard schema version {manifest.get('schema_version')}, this eyas reads version "
            f"{SCHEMA_VERSION}; dump again with this version (`eyas dump RECIPE`)"
        )
    return manifest


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
            return load(payload)
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise EyasError(f"shard index '{path}' cannot be read ({exc}); rerun `eyas dump RECIPE`") from None

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
                raise EyasError(f"shard file '{path}' is corrupt: {problem}; rerun `eyas dump RECIPE` to repair it")
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
                                "does not match its checksum; rerun `eyas dump RECIPE` to repair it")
        self._sample_ok[i] = True

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i: input_ids long [T], loss_mask float [T], decoded features [T, ...]."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
        shard, row = int(self._index["shard"][i]), int(self._index["row"][i])
        handle = self._handle(shard)
        offsets = self._offsets[shard]
        start, end = int(offsets[row]), int(offsets[row + 1])
        verify = self.verify and not self._sample_ok[i]
        names = self._checked[shard][0] if verify else None
        raw: dict[str, torch.Tensor] = {}

        def read(name: str) -> torch.Tensor:
            if name not in raw:
                raw[name] = self._read(handle, name, start, end)
            return raw[name]

        if verify:
            for name in names:
                read(name)
            self._check_sample(i, shard, row, raw)
        out = {"input_ids": read("input_ids").long(), "loss_mask": read("loss_mask").to(torch.float32)}
        features = self.manifest["features"]

        def decoded(name: str, encoding: str) -> torch.Tensor:
            scale = read(name + ".scale") if encoding in ("int8", "fp8", "int4") else None
            return decode(read(name), scale, encoding, self.dtype)

        if "aux_hidden" in features:
            encs = features["aux_hidden"]["encodings"]
            out["aux_hidden"] = torch.cat([decoded(f"aux_hidden.{j}", enc) for j, enc in enumerate(encs)], dim=-1)
        if "last_hidden" in features:
            out["last_hidden"] = decoded("last_hidden", features["last_hidden"]["encoding"])
        if "topk_values" in features:
            out["topk_values"] = read("topk_values").to(torch.float32)
            out["topk_ids"] = read("topk_ids").long()
        return out



# ----------------------------------------------------------------------------- batching


def pad_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad samples to the longest; attention_mask marks real tokens."""
    longest = max(s["input_ids"].numel() for s in samples)
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        first = samples[0][key]
        out = first.new_zeros((len(samples), longest) + tuple(first.shape[1:]))
        for b, s in enumerate(samples):
            out[b, : s[key].shape[0]] = s[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros(len(samples), longest, dtype=torch.long)
    for b, s in enumerate(samples):
        batch["attention_mask"][b, : s["input_ids"].numel()] = 1
    return batch


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


class TokenBudgetLoader:
    """Padded batches of at most `token_budget` tokens, shuffled by (seed, epoch), split by rank.

    The epoch's order is built lazily, a window of samples at a time (the permutation, then each
    window sorted by length and cut into budget batches whose order is shuffled), so the first
    batch costs the same for any dataset size and padding stays small. Batches are dealt to ranks
    in groups of `world_size`; an incomplete last group is dropped so every rank takes the same
    number of steps. `state_dict()` is this rank's position (epoch, batches taken); iterating
    after `load_state_dict` continues exactly where the saved run stopped.
    """

    def __init__(self, reader: ShardReader, token_budget: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, window: int = 2048):
        if token_budget <= 0:
            raise EyasError(f"token_budget must be > 0, got {token_budget}")
        if not 0 <= rank < world_size:
            raise EyasError(f"rank {rank} is outside world_size {world_size}")
        self.reader, self.token_budget, self.seed = reader, int(token_budget), int(seed)
        self.rank, self.world_size, self.shuffle, self.window = rank, world_size, shuffle, int(window)
        self.epoch = 0
        self.position = 0  # batches this rank has taken in the current epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; the position restarts unless it is the epoch already under way."""
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def _rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, salt])

    def _global_batches(self) -> Iterator[np.ndarray]:
        """The epoch's batches (sample indices) for all ranks, in order, built one window at a time."""
        lengths = self.reader.lengths
        n = len(lengths)
        order = self._rng(0).permutation(n) if self.shuffle else np.arange(n)
        for w, start in enumerate(range(0, n, self.window)):
            chunk = order[start:start + self.window]
            chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
            batches = budget_batches(chunk, lengths, self.token_budget)
            if self.shuffle:
                batches = [batches[j] for j in self._rng(w + 1).permutation(len(batches))]
            yield from batches

    def _rank_batches(self) -> Iterator[np.ndarray]:
        group: list[np.ndarray] = []
        for batch in self._global_batches():
            group.append(batch)
            if len(group) == self.world_size:
                yield group[self.rank]
                group = []

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        skip = self.position
        for taken, indices in enumerate(self._rank_batches()):
            if taken < skip:
                continue  # resuming: index arithmetic only, no data is read
            samples = [self.reader.sample(int(i)) for i in indices]
            self.position = taken + 1
            yield pad_batch(samples)
        self.epoch, self.position = self.epoch + 1, 0  # a finished epoch moves on to the next order

    def __len__(self) -> int:
        """Batches this rank takes per epoch (walks the epoch's index plan: O(samples), no data read)."""
        return sum(1 for _ in self._rank_batches())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "token_budget": self.token_budget,
                "rank": self.rank, "world_size": self.world_size, "shuffle": self.shuffle, "window": self.window,
                "num_samples": len(self.reader)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "token_budget", "world_size", "shuffle", "window", "num_samples"):
            mine = len(self.reader) if key == "num_samples" else getattr(self, key)
            if key in state and state[key] != mine:
                raise EyasError(
                    f"cannot resume the data position: it was saved with {key}={state[key]!r}, this run has "
                    f"{mine!r}; resume with the same settings and shards, or start a new run"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


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
                            "rerun `eyas dump RECIPE` to repair them")
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
