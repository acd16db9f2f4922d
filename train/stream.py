"""`train.source: stream`: each sample's features captured by vLLM engines as training reads it.

`StreamReader` is a split of the prepared data seen through the interface the loader reads shards with (`lengths`,
`codes(i)`, the manifest's `features`), so batching, order, resume and the decode on the training device are the
shards' own. Its sample `i` is the dump's sample `i`: the prepared rows in the dump's plan order
(`plan_shards`: longest first), so a streamed run draws the same batches as a run from that data's shards for the
same seed. Each capture is encoded as soon as it arrives, on the fleet's thread, exactly as the dump encodes
(`encode_features`, `dump.encoding`): a streamed batch holds the very codes a shard would, and the window holds
codes, not the engine's fp32.

The window: the loader's read-ahead asks the engines for the samples of the batches ahead (`request`) until
`train.stream_window` samples are asked and not yet read; each engine file is read and deleted as its answer
arrives. So the stream holds at most a window of samples on disk and in host memory, whatever the dataset's size.

Epochs after the first (`train.stream_cache`): `keep` writes each sample's codes under `<run>/stream/cache/` as the
first epoch reads them (a folder per target, layers, encoding and data, so another setting never reads them), and a
later read of the sample (a later epoch, a resumed run) takes them from there; `none` asks the engines again.

`report()` counts how often each sample was read: a run whose engine was killed reads every sample as often as one
whose engine was not (the closing test of the engine-kill case).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.dump import data_fingerprint, encode_features, feature_spec, manifest_features, plan_shards, sample_lengths
from eyas.data.dump_vllm import capture_layer_ids, final_norm, split_layers
from eyas.data.memory import shard_bytes
from eyas.data.prepare import load_prepared
from eyas.data.shard_format import ids_dtype
from eyas.errors import EyasError
from eyas.memory import GIB
from eyas.recipe_schema import Recipe
from eyas.stage_cli import command_help, stage_main, stage_parser
from eyas.targets import load_target_config, load_tokenizer, pick_device, resolve_dtype, resolve_target_path, target_identity
from eyas.train.engines import EngineFleet, EngineSpec, local_storage, wait_until_up

CACHE_FILL = 0.5  # `auto` keeps a cache that takes at most this share of the free disk


@dataclass(frozen=True)
class Capture:
    """What turns an engine's captured layers into a shard's codes: the dump's feature spec and encodings."""

    spec: dict  # `feature_spec`: the fused layers, whether the last hidden state is stored, the encodings
    layer_ids: list[int]  # the engine's captured ids, in its order
    depth: int  # the target's layers (vLLM's id of the last layer's stream)
    features: dict  # the manifest's `features`, as the loader decodes them
    norm: Any  # the target's final norm (for the last hidden state), or None
    ids_dtype: torch.dtype


class StreamReader:
    """One split of the prepared data with its features from the engines (module docstring)."""

    def __init__(self, dataset: Any, fleet: EngineFleet, capture: Capture, shard_tokens: int, window: int,
                 cache: Path | None) -> None:
        prepared = sample_lengths(dataset)
        self.order = np.concatenate(plan_shards(prepared, shard_tokens)) if len(prepared) else prepared
        self._lengths = prepared[self.order]
        self.dataset, self.fleet, self.capture = dataset, fleet, capture
        self.manifest = {"features": capture.features}
        self.dtype = torch.float32
        self.window, self.cache = int(window), cache
        self.reads = np.zeros(len(self.order), dtype=np.int64)  # times each sample was read (report)
        self._asked: dict[int, Future] = {}
        self._guard = threading.Lock()
        self.most_asked = 0  # the window's high-water mark

    def __len__(self) -> int:
        return len(self.order)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def prepared_index(self, i: int) -> int:
        return int(self.order[i])

    def _row(self, i: int) -> dict:
        return self.dataset[int(self.order[i])]

    def request(self, indices: Any) -> None:
        """Ask the engines for these samples now (the ones already asked or cached are skipped)."""
        with self._guard:
            for i in map(int, indices):
                if i not in self._asked and not self._is_cached(i):
                    row = self._row(i)
                    self._asked[i] = self.fleet.submit(i, row["input_ids"], functools.partial(self._encode, row))
            self.most_asked = max(self.most_asked, len(self._asked))

    def codes(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i as a shard stores it: ids, loss mask, feature codes and scales."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
        self.reads[i] += 1
        if self._is_cached(i):
            from safetensors.torch import load_file

            return load_file(str(self._cached(i)))
        self.request([i])
        with self._guard:
            asked = self._asked[i]
        try:
            codes = asked.result()
        finally:
            with self._guard:
                self._asked.pop(i, None)
        self.fleet.release(codes)
        if self.cache is not None:
            _save_atomic(codes, self._cached(i))
        return codes

    def _encode(self, row: dict, captured: torch.Tensor) -> dict[str, torch.Tensor]:
        """A prepared row's captured layers as a shard stores them (run on the fleet's thread)."""
        c = self.capture
        with torch.no_grad():
            aux, last = split_layers(captured[None], c.layer_ids, c.spec["aux_layers"], c.depth, c.norm,
                                     c.spec["last_hidden"])
            real = torch.ones(1, captured.shape[0], dtype=torch.bool)
            codes = encode_features(c.spec, aux, last, real, None)
        codes["input_ids"] = torch.as_tensor(row["input_ids"], dtype=torch.int32).to(c.ids_dtype)
        codes["loss_mask"] = torch.as_tensor(row["loss_mask"], dtype=torch.uint8)
        return codes

    def _cached(self, i: int) -> Path:
        return self.cache / f"{i}.safetensors"

    def _is_cached(self, i: int) -> bool:
        return self.cache is not None and self._cached(i).is_file()

    def report(self) -> dict:
        return {"samples": len(self), "reads": self.reads.tolist(), "most_asked": self.most_asked,
                "window": self.window, "cache": str(self.cache) if self.cache else None}


def _save_atomic(codes: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    save_file({k: v.contiguous() for k, v in codes.items()}, str(temp))
    os.replace(temp, path)


# ----------------------------------------------------------------------------- the source


class Stream:
    """The engines a streamed run started (or reached), its fleet and both splits' readers; `close` stops them."""

    def __init__(self, fleet: EngineFleet, servers: list, readers: dict[str, StreamReader], report_path: Path) -> None:
        self.fleet, self.servers, self.readers, self.report_path = fleet, servers, readers, report_path
        self.closed = False

    def close(self, trained: Any = None) -> None:
        """Stop the engines this run started; write the report (`trained`: each train sample's steps, this process).
        Once: a later call (a run's failure path after its own close) does nothing."""
        if self.closed:
            return
        self.closed = True
        self.fleet.close()
        report = {"fleet": self.fleet.report(), **{split: r.report() for split, r in self.readers.items()}}
        if trained is not None:
            report["train"]["trained"] = [int(n) for n in trained]
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(json.dumps(report))
        for server in self.servers:
            server.stop()


def engine_spec(recipe: Recipe, target_config: Any, identity: str) -> EngineSpec:
    """How this recipe's capture engines run: the dump's layers of the target, in the target's dtype."""
    depth = int(target_config.num_hidden_layers)
    spec = feature_spec(recipe, target_config)
    dtype = resolve_dtype(recipe.target.dtype, pick_device(recipe.target.device))
    return EngineSpec(target=str(resolve_target_path(recipe.target.path)), dtype=str(dtype).replace("torch.", ""),
                      layer_ids=capture_layer_ids(spec["aux_layers"], spec["last_hidden"], depth),
                      storage=local_storage(recipe), identity=identity,
                      max_model_len=int(recipe.data.max_length) + 8,
                      tensor_parallel_size=int(recipe.dump.vllm_tensor_parallel_size),
                      enforce_eager=bool(recipe.dump.vllm_enforce_eager), batch=int(recipe.train.stream_batch))


def engine_urls(recipe: Recipe) -> list[str]:
    train = recipe.train
    return list(train.stream_endpoints) or [f"http://127.0.0.1:{train.stream_port + e}/v1"
                                            for e in range(train.stream_engines)]


def open_stream(recipe: Recipe, target_config: Any, identity: str) -> tuple[Stream, list[int]]:
    """Start (local rank 0) or reach the engines, and open both splits; returns the stream and the fused layers."""
    try:
        import hs_connectors  # noqa: F401
    except ImportError:
        raise EyasError("train.source=stream reads the engines' files through hs-connectors: "
                        "pip install 'hs-connectors>=0.9.0' (or `pip install -e .[stream]`)") from None
    cfg, run_dir = recipe.train, recipe.run_dir
    engines = engine_spec(recipe, target_config, identity)
    urls = engine_urls(recipe)
    servers: list = []
    try:  # anything failing from here stops the engines this process started
        if cfg.stream_engines and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            engines.storage.mkdir(parents=True, exist_ok=True)  # shared by every node's engines: never emptied here
            for e in range(cfg.stream_engines):
                servers.append(engines.server(cfg.stream_port + e, run_dir / "stream" / f"engine-{e}.log").start())
        wait_until_up(urls, timeout_s=900 if cfg.stream_engines else cfg.stream_timeout_s)
        fleet = EngineFleet(urls, engines.storage, identity, engines.layer_ids, cfg.stream_timeout_s,
                            workers=cfg.stream_window)
        spec = feature_spec(recipe, target_config)
        depth = int(target_config.num_hidden_layers)
        dtype = getattr(torch, engines.dtype)  # the norm runs in the engine's dtype, as the vLLM dump's does
        capture = Capture(spec, engines.layer_ids, depth, manifest_features(spec, int(target_config.hidden_size)),
                          final_norm(target_config, Path(engines.target), dtype) if depth in engines.layer_ids else None,
                          ids_dtype(int(target_config.vocab_size)))
        readers = {}
        keep = keeps_cache(recipe, target_config)
        for split in ("train", "heldout"):
            dataset = load_prepared(run_dir, split)
            cache = cache_folder(recipe, identity, spec, dataset, split) if keep else None
            readers[split] = StreamReader(dataset, fleet, capture, recipe.dump.shard_tokens, cfg.stream_window, cache)
        rank = int(os.environ.get("RANK", "0"))
        return Stream(fleet, servers, readers, run_dir / "stream" / f"report.rank{rank}.json"), spec["aux_layers"]
    except BaseException:
        for server in servers:
            server.stop()
        raise


def cache_folder(recipe: Recipe, identity: str, spec: dict, dataset: Any, split: str) -> Path:
    """Where a split's captured codes are kept for later epochs: a folder per target, layers, encodings and data."""
    key = json.dumps([identity, spec["aux_layers"], spec["aux_encodings"], spec["last_encoding"],
                      data_fingerprint(dataset)])
    return recipe.run_dir / "stream" / "cache" / f"{split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def cache_bytes(recipe: Recipe, target_config: Any) -> int:
    """The cache's size on disk for the whole prepared data (both splits), as the dump would store it."""
    tokens = sum(int(sample_lengths(load_prepared(recipe.run_dir, split)).sum()) for split in ("train", "heldout"))
    return tokens * sum(shard_bytes(recipe, target_config).values())


def keeps_cache(recipe: Recipe, target_config: Any) -> bool:
    """`train.stream_cache`: keep, none, or auto (more than one epoch and the cache fits in CACHE_FILL of free disk)."""
    choice = recipe.train.stream_cache
    if choice != "auto":
        return choice == "keep"
    if recipe.train.epochs <= 1:
        return False
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    return cache_bytes(recipe, target_config) <= CACHE_FILL * shutil.disk_usage(recipe.run_dir).free


def plan_lines(recipe: Recipe, config: Any, shapes: Any, draft: Any, trainers: int, lengths: dict | None,
               engine_tokens_per_s: float | None = None, trainer_tokens_per_s: float | None = None) -> list[str]:
    """`eyas plan`'s lines for a streamed run: engines per trainer GPU, the window's memory, the cache's choice.

    Engines: a capture costs the target's forward, 2·P FLOPs a token; a training token the draft's unrolled steps
    forward and backward, 6·(trainable)·K, and the teacher's lm_head, 2·h·V. At equal utilisation, trainer FLOPs
    over engine FLOPs is the engines one trainer GPU needs. Measured rates (`--engine-tokens-per-s`,
    `--trainer-tokens-per-s`: benchmarks/bench_stream.py prints both for its machine) replace the estimate."""
    cfg = recipe.train
    steps = max(1, int(cfg.ttt_steps))
    engine_cost = 2.0 * shapes.params
    trainer_cost = 6.0 * draft.trainable * steps + 2.0 * shapes.hidden * shapes.vocab
    if engine_tokens_per_s and trainer_tokens_per_s:
        per_trainer, how = trainer_tokens_per_s / engine_tokens_per_s, (
            f"measured: an engine captures {engine_tokens_per_s:,.0f} tokens/s, a trainer reads {trainer_tokens_per_s:,.0f}")
    else:
        per_trainer, how = trainer_cost / engine_cost, (
            f"estimate at equal utilisation: {engine_cost / 1e9:.1f} GFLOP a captured token against "
            f"{trainer_cost / 1e9:.1f} GFLOP a trained one; --engine-tokens-per-s/--trainer-tokens-per-s take "
            "measured rates")
    engines = max(1, math.ceil(per_trainer * trainers - 1e-9))
    mean = float(np.mean(lengths["train"])) if lengths and len(lengths["train"]) else float(recipe.data.max_length)
    spec = feature_spec(recipe, config)
    captured = len(capture_layer_ids(spec["aux_layers"], spec["last_hidden"], shapes.layers))
    width = 4 if recipe.target.dtype == "float32" else 2  # bytes a value in the engine's dtype (auto: bf16 on a GPU)
    tokens = cfg.stream_window * mean
    files = tokens * captured * shapes.hidden * width  # the engine's files, before they are read
    codes = tokens * sum(shard_bytes(recipe, config).values())  # what the window holds: captures encoded as stored
    lines = [f"stream: {engines} engine GPU(s) keep {trainers} trainer GPU(s) fed ({per_trainer:.2f} per trainer; "
             f"{how})",
             f"{'':8}window of {cfg.stream_window} samples (mean {mean:,.0f} tokens) per trainer process: "
             f"{files / GIB:.2f} GiB of engine files on disk, {codes / GIB:.2f} GiB of codes in host memory, at most"]
    if lengths:
        size = sum(int(v.sum()) for v in lengths.values()) * sum(shard_bytes(recipe, config).values())
        choice = "kept" if keeps_cache(recipe, config) else "not kept"
        lines.append(f"{'':8}cache for later epochs ({cfg.stream_cache}): {size / GIB:,.1f} GiB, {choice}")
    return lines


# ----------------------------------------------------------------------------- `eyas engine`


def main(argv: list[str] | None = None) -> int:
    """`eyas engine RECIPE [--port P] [--host H]`: one capture engine for the recipe's streamed training, in the
    foreground until stopped (SIGTERM, Ctrl-C); a run names it in train.stream_endpoints."""
    parser = stage_parser("eyas engine", command_help("engine", main.__doc__), force=False)
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: train.stream_port)")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: every interface)")

    def body(recipe: Recipe, args: argparse.Namespace) -> int:
        config = load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
        spec = engine_spec(recipe, config, target_identity(config, load_tokenizer(recipe.target)))
        spec.storage.mkdir(parents=True, exist_ok=True)
        port = args.port or recipe.train.stream_port
        server = spec.server(port, recipe.run_dir / "stream" / f"engine-{socket.gethostname()}-{port}.log",
                             host=args.host).start()
        signal.signal(signal.SIGTERM, lambda *_: server.stop())
        print(f"eyas engine: capturing layers {spec.layer_ids} of {spec.target} at "
              f"http://{socket.getfqdn()}:{port}/v1 into {spec.storage} (log {server.log}); stop it with Ctrl-C",
              flush=True)
        try:
            return server.proc.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()

    return stage_main("engine", argv, body, parser=parser)
