"""The on-disk format of a dump: its files, the encodings of the stored features, the per-sample
checksum, and what makes a shard header and a manifest well formed.

Written by `eyas.data.shard_writer` (`eyas dump`), read by `eyas.data.shard_reader`, checked in full
by `eyas.data.shard_verify` (`eyas verify`); the trainer's loader (`eyas.train.loader`) decodes its
batches of stored codes with `decode_sample`, the function `ShardReader.sample` decodes with.

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
                            `sample_crc32` int64 [n] (CRC-32 of each sample's bytes: its rows of
                            every per-token tensor, in name order; `sample_checksums`).
    shard-00000.json        the shard's sidecar (sha256, bytes, counts): a shard is done when both
                            files exist and agree; a killed writer leaves neither (temp + rename).

Each shard's safetensors metadata holds the fingerprint of the dump plan it was written for
(target identity, data, settings; also in the manifest as `plan`) and its own shard number
(`header_problem` checks both, and the counts, against a dump).

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

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.io import json_problem

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.safetensors"
ENCODINGS = ("bf16", "fp16", "fp8", "int8", "int4")
INT4_GROUP = 32
FP8_MAX = 448.0
CHECKSUM = "sample_crc32"  # per sample: CRC-32 over its rows of every per-token tensor (sorted by name)
NOT_PER_TOKEN = ("offsets", "sample_index", CHECKSUM)
MAX_HEADER = 100 << 20  # safetensors' own limit on a header


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


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def rows_bytes(t: torch.Tensor) -> np.ndarray:
    """A per-token tensor as bytes, one row per token ([N, bytes per token], uint8)."""
    t = t.contiguous()
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
    return flat.view(torch.uint8).numpy()


def sample_checksums(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """CRC-32 per sample over its rows of every per-token tensor, in name order (int64 [n])."""
    offsets = tensors["offsets"].tolist()
    rows = [rows_bytes(tensors[name]) for name in sorted(tensors) if name not in NOT_PER_TOKEN]
    sums = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        crc = 0
        for r in rows:
            crc = zlib.crc32(r[start:end], crc)
        sums.append(crc)
    return torch.tensor(sums, dtype=torch.int64)


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
