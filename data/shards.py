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
    shard-00000.json        the shard's sidecar (sha256, bytes, counts): a shard is done when both
                            files exist and agree; a killed writer leaves neither (temp + rename).

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
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from eyas.errors import EyasError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.safetensors"
ENCODINGS = ("bf16", "fp16", "fp8", "int8", "int4")
INT4_GROUP = 32
FP8_MAX = 448.0
OPEN_HANDLES = 64  # safetensors handles kept open by a reader (least recently used are closed)


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


def bytes_per_element(encoding: str) -> float:
    return {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 2.0 / INT4_GROUP}[encoding]


def ids_dtype(vocab_size: int) -> torch.dtype:
    """Token ids on disk: 2 bytes when the vocabulary fits (SmolLM2, Llama-2), else 4."""
    return torch.uint16 if vocab_size <= 65536 else torch.int32


# ----------------------------------------------------------------------------- writing


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EyasError(
            f"cannot write '{path}': {exc.strerror or exc}; free disk space or fix permissions and rerun "
            "(finished files are kept)"
        ) from None


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(directory: Path, index: int, tensors: dict[str, torch.Tensor], metadata: dict) -> dict:
    """Serialise one shard (bytes are deterministic for equal tensors), write it and its sidecar."""
    from safetensors.torch import save

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


def read_sidecar(directory: Path, index: int) -> dict | None:
    path = directory / shard_name(index).replace(".safetensors", ".json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_shard(directory: Path, index: int, full: bool = True) -> str:
    """'' if shard `index` is complete and intact, else why not (missing, truncated, checksum)."""
    record = read_sidecar(directory, index)
    path = directory / shard_name(index)
    if record is None:
        return "missing" if not path.exists() else "no sidecar (interrupted write)"
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"truncated or resized ({size} bytes, expected {record['bytes']})"
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
    """Full check of a dump: every shard's sha256 against the manifest. Returns problems, one per file."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    problems = []
    for record in manifest["shards"] + [manifest["index"]]:
        path = shard_dir / record["file"]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != record["bytes"]:
            problems.append(f"{path}: truncated ({path.stat().st_size} bytes, manifest says {record['bytes']})")
        elif sha256_file(path) != record["sha256"]:
            problems.append(f"{path}: checksum mismatch (corrupt)")
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
    """Random access to the samples of a dump: lazy, memory-mapped, validated on open.

    Opening reads only manifest.json and the small index (memory-mapped), and checks that every
    file exists with its recorded size (a cheap stat per shard; `verify()` hashes the bytes).
    Shard files are opened with safetensors' `safe_open` the first time a sample needs them.
    `expect_identity`: the target identity the caller trains for; shards of another target or
    tokenizer are refused with the reason.
    """

    def __init__(self, shard_dir: str | Path, expect_identity: str | None = None, dtype: torch.dtype = torch.float32):
        self.shard_dir = Path(shard_dir)
        self.manifest = read_manifest(self.shard_dir)
        self.dtype = dtype
        if expect_identity is not None and self.manifest["target_identity"] != expect_identity:
            raise EyasError(
                f"the shards in '{self.shard_dir}' were dumped from another target or tokenizer "
                f"(identity {self.manifest['target_identity']}, target '{self.manifest.get('target_path')}'), "
                f"not the one this run uses (identity {expect_identity}); dump again for this target"
            )
        self._check_files()
        self._index = self._load_index()
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._offsets: dict[int, torch.Tensor] = {}

    # -- opening
    def _check_files(self) -> None:
        problems = []
        for record in self.manifest["shards"] + [self.manifest["index"]]:
            path = self.shard_dir / record["file"]
            if not path.is_file():
                problems.append(f"'{path}' is missing")
            elif path.stat().st_size != record["bytes"]:
                problems.append(f"'{path}' is truncated or altered ({path.stat().st_size} bytes, "
                                f"the manifest says {record['bytes']})")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise EyasError(f"{len(problems)} shard file(s) are missing or damaged: {'; '.join(problems[:5])}{more}; "
                            "rerun `eyas dump RECIPE` to repair them")

    def _load_index(self) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        path = self.shard_dir / INDEX
        try:
            with safe_open(str(path), "pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
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
            self._offsets[shard] = handle.get_tensor("offsets")
        except Exception as exc:
            raise EyasError(f"shard file '{path}' cannot be read ({exc}); rerun `eyas dump RECIPE` to repair it") from None
        self._handles[shard] = handle
        if len(self._handles) > OPEN_HANDLES:
            old, _ = self._handles.popitem(last=False)
            self._offsets.pop(old, None)
        return handle

    def __getstate__(self):  # DataLoader workers re-open files lazily in their own process
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"] = OrderedDict(), {}
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

    def _read(self, handle, name: str, start: int, end: int) -> torch.Tensor:
        return handle.get_slice(name)[start:end]

    def _decode_feature(self, handle, name: str, encoding: str, start: int, end: int) -> torch.Tensor:
        codes = self._read(handle, name, start, end)
        scale = self._read(handle, name + ".scale", start, end) if encoding in ("int8", "fp8", "int4") else None
        return decode(codes, scale, encoding, self.dtype)

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i: input_ids long [T], loss_mask float [T], decoded features [T, ...]."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
        shard, row = int(self._index["shard"][i]), int(self._index["row"][i])
        handle = self._handle(shard)
        offsets = self._offsets[shard]
        start, end = int(offsets[row]), int(offsets[row + 1])
        out = {
            "input_ids": self._read(handle, "input_ids", start, end).long(),
            "loss_mask": self._read(handle, "loss_mask", start, end).to(torch.float32),
        }
        features = self.manifest["features"]
        if "aux_hidden" in features:
            encs = features["aux_hidden"]["encodings"]
            parts = [self._decode_feature(handle, f"aux_hidden.{j}", enc, start, end) for j, enc in enumerate(encs)]
            out["aux_hidden"] = torch.cat(parts, dim=-1)
        if "last_hidden" in features:
            out["last_hidden"] = self._decode_feature(handle, "last_hidden", features["last_hidden"]["encoding"], start, end)
        if "topk_values" in features:
            out["topk_values"] = self._read(handle, "topk_values", start, end).to(torch.float32)
            out["topk_ids"] = self._read(handle, "topk_ids", start, end).long()
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
