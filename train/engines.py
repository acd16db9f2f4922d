"""The capture engines of `train.source: stream`: vLLM servers of the target that capture each sample's features.

An engine is `vllm serve` of the target with vLLM's `extract_hidden_states` method and eyas's hidden-states
connector (`eyas.data.dump_vllm`: the dump's own capture, so a streamed sample's features are what
`dump.backend: vllm` stores). A capture is one completion request of the sample's token ids with `max_tokens` 1;
the engine answers with `kv_transfer_params` naming the file it wrote, and hs-connectors' `FileTransfer` reads it
(waiting on the connector's `.lock` until the write is whole). The engines and the trainers share that folder
(one node, or a shared filesystem).

`EngineFleet.capture` asks the engines in turn, starting at one chosen by the sample's index (so E engines share R
trainer processes' requests evenly); an engine that refuses or drops the connection (killed, restarting) is
skipped and the sample asked of the next, and while every engine is down the sample waits for one to come back,
up to `train.stream_timeout_s`. An engine that takes the request and then answers nothing within that time is
stalled: an error names it rather than a hang. Every file is stamped by the connector with the layers the engine
captures and the target identity it was started for; a file from another target, tokenizer or layers is refused
with the fix.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.data.dump_vllm import capture_config
from eyas.errors import EyasError
from eyas.vllm_server import VllmServer, answers

SERVED_NAME = "target"
IDENTITY_KEY = "eyas_target_identity"
ENGINE_KV_CACHE_GIB = 2  # a capture engine's KV cache on a CPU (VLLM_CPU_KVCACHE_SPACE): one window of samples
DOWN_ERRORS = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead)


@dataclass
class EngineSpec:
    """What an engine is started with: the target, its dtype and layers, the folder the files go to."""

    target: str  # the target's folder
    dtype: str  # float32, bfloat16, float16
    layer_ids: list[int]  # vLLM's captured ids (`capture_layer_ids`)
    storage: Path
    identity: str  # the eyas target identity every file is stamped with
    max_model_len: int
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    batch: int = 1  # requests computed together (train.stream_batch)

    def serve_args(self) -> list[str]:
        """`vllm serve` arguments beyond VllmServer's own (model, port, dtype, length, eager, seed)."""
        config = capture_config(self.layer_ids, self.storage, lock=True, stamp={IDENTITY_KEY: self.identity})
        return ["--no-enable-prefix-caching", "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--max-num-seqs", str(self.batch),
                "--max-num-batched-tokens", str(max(self.max_model_len, 8192)),
                "--speculative-config", json.dumps(config["speculative_config"]),
                "--kv-transfer-config", json.dumps(config["kv_transfer_config"])]

    def server(self, port: int, log: Path, host: str = "127.0.0.1", timeout: float = 900) -> VllmServer:
        return VllmServer(self.target, log=log, port=port, dtype=self.dtype, max_model_len=self.max_model_len,
                          timeout=timeout, kv_cache_gib=ENGINE_KV_CACHE_GIB, extra_args=self.serve_args(),
                          served_name=SERVED_NAME, in_process_engine=True, host=host,
                          eager=self.enforce_eager)


@dataclass
class Engine:
    url: str  # http://HOST:PORT/v1
    answered: int = 0
    dropped: int = 0  # requests it refused or dropped (asked again elsewhere)


@dataclass
class FleetCounts:
    captures: int = 0
    retries: int = 0  # requests asked again of another engine (or the same after its restart)
    held_bytes: int = 0  # finished captures (as stored codes) in host memory, not yet read by the trainer
    most_held_bytes: int = 0  # the run's high-water mark of held_bytes


class EngineFleet:
    """Captures samples through E engines; `submit` runs a capture on one of `workers` threads."""

    def __init__(self, urls: list[str], storage: Path, expect_identity: str, expect_layers: list[int],
                 timeout_s: float, workers: int) -> None:
        from hs_connectors import FileTransfer  # the stream's one extra dependency: named when missing (open_stream)

        self.engines = [Engine(url.rstrip("/")) for url in urls]
        self.transfer = FileTransfer(storage)
        self.expect_identity, self.expect_layers = expect_identity, list(expect_layers)
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._closed = threading.Event()  # set by close: a capture waiting for an engine to come back gives up
        self.counts = FleetCounts()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        # daemon threads: a request to a stalled engine never holds up the exit (close waits a bounded time)
        self._threads = [threading.Thread(target=self._serve, name=f"eyas-capture-{n}", daemon=True)
                         for n in range(max(1, workers))]
        for thread in self._threads:
            thread.start()

    def submit(self, index: int, token_ids: list[int], finish: Callable[[torch.Tensor], dict]) -> Future:
        """Capture sample `index` on one of the fleet's threads, which also runs `finish` on the captured layers
        (the encode to stored codes, 4x smaller than the engine's fp32); the Future holds its result or error."""
        future: Future = Future()
        self._work.put((future, index, token_ids, finish))
        return future

    def _serve(self) -> None:
        while True:
            future, index, token_ids, finish = self._work.get()
            if future is None or self._closed.is_set():
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = finish(self.capture(index, token_ids))
            except BaseException as exc:  # handed to the reader, raised there
                future.set_exception(exc)
                continue
            self._hold(_nbytes(result))
            future.set_result(result)

    def _hold(self, nbytes: int) -> None:
        """Count `nbytes` of finished captures into host memory (negative: the trainer took them)."""
        with self._lock:
            self.counts.held_bytes += nbytes
            self.counts.most_held_bytes = max(self.counts.most_held_bytes, self.counts.held_bytes)

    def release(self, result: dict) -> None:
        """The reader has taken a result `submit` returned: it no longer counts as held by the stream."""
        self._hold(-_nbytes(result))

    def capture(self, index: int, token_ids: list[int]) -> torch.Tensor:
        """Sample `index`'s captured layers, [T, len(layer ids), H], asking the engines in turn (module docstring)."""
        deadline = time.monotonic() + self.timeout_s
        start = index % len(self.engines)
        down: dict[str, str] = {}
        attempt = 0
        while True:
            engine = self.engines[(start + attempt) % len(self.engines)]
            attempt += 1
            try:
                params = self._ask(engine, token_ids)
            except DOWN_ERRORS + (urllib.error.URLError,) as exc:
                if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, TimeoutError):
                    raise self._stalled(engine, index) from None
                down[engine.url] = str(getattr(exc, "reason", exc))
                with self._lock:
                    engine.dropped += 1
                    self.counts.retries += 1
                if time.monotonic() > deadline:
                    raise EyasError(f"train.source=stream: no engine answered sample {index} in "
                                    f"{self.timeout_s:.0f} s (train.stream_timeout_s): "
                                    + "; ".join(f"{url}: {why}" for url, why in down.items())
                                    + "; start the engines (`eyas engine RECIPE`) or fix train.stream_endpoints") from None
                if attempt % len(self.engines) == 0 and self._closed.wait(1.0):  # every engine down: wait for one
                    raise EyasError("train.source=stream: the stream was closed while a capture waited for an engine") from None
                continue
            except TimeoutError:
                raise self._stalled(engine, index) from None
            hidden = self._read(engine, params, token_ids)
            with self._lock:
                engine.answered += 1
                self.counts.captures += 1
            return hidden

    def _ask(self, engine: Engine, token_ids: list[int]) -> dict:
        body = json.dumps({"model": SERVED_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}).encode()
        request = urllib.request.Request(f"{engine.url}/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise EyasError(f"train.source=stream: the engine at {engine.url} refused a capture ({exc.code}): "
                            f"{detail}") from None
        params = answer.get("kv_transfer_params") or {}
        if "hidden_states_path" not in params:
            raise EyasError(f"train.source=stream: the server at {engine.url} answered without a hidden-states file: "
                            "it is not a capture engine; start it with `eyas engine RECIPE`")
        return params

    def _read(self, engine: Engine, params: dict, token_ids: list[int]) -> torch.Tensor:
        from safetensors import safe_open

        path = params["hidden_states_path"]
        try:
            payload = self.transfer.get_generated(params)
        except TimeoutError:
            raise self._stalled(engine, -1, f"its file {path} stayed locked") from None
        if payload is None:
            raise EyasError(f"train.source=stream: the engine at {engine.url} named {path}, which this process cannot "
                            "read: engines and trainers must share that folder (one node, or a shared filesystem)")
        with safe_open(path, framework="pt") as handle:
            stamp = handle.metadata() or {}
        self.transfer.delete(path)
        self._check(engine, stamp, payload, token_ids)
        return payload["hidden_states"]

    def _check(self, engine: Engine, stamp: dict, payload: dict, token_ids: list[int]) -> None:
        fix = "start the engines with this run's recipe (`eyas engine RECIPE`), or point train.stream_endpoints at them"
        identity = stamp.get(IDENTITY_KEY)
        if identity != self.expect_identity:
            raise EyasError(f"train.source=stream: the engine at {engine.url} captures another target or tokenizer "
                            f"(identity {identity or 'unstamped'}, this run's target is {self.expect_identity}); {fix}")
        layers = json.loads(stamp.get("eyas_layer_ids", "null"))
        if layers != self.expect_layers:
            raise EyasError(f"train.source=stream: the engine at {engine.url} captures layers {layers}, this run reads "
                            f"{self.expect_layers} (dump.layers); {fix}")
        if payload["token_ids"].tolist() != list(token_ids):
            raise EyasError(f"train.source=stream: the engine at {engine.url} returned another sample's tokens")

    def _stalled(self, engine: Engine, index: int, what: str = "") -> EyasError:
        sample = f" sample {index}" if index >= 0 else " a sample"
        return EyasError(f"train.source=stream: the engine at {engine.url} took{sample} and answered nothing in "
                         f"{self.timeout_s:.0f} s (train.stream_timeout_s){'; ' + what if what else ''}: it is "
                         "stalled; restart it, or raise train.stream_timeout_s for a slower engine")

    def report(self) -> dict:
        return {"captures": self.counts.captures, "retries": self.counts.retries,
                "most_held_bytes": self.counts.most_held_bytes,
                "engines": {e.url: {"answered": e.answered, "dropped": e.dropped} for e in self.engines}}

    def close(self, wait_s: float = 30.0) -> None:
        """Start no more captures and wait (up to `wait_s`) for those under way: a thread still in a capture's
        tensor code when the interpreter exits aborts the process."""
        self._closed.set()
        for _ in self._threads:  # wake the idle threads so they see the close
            self._work.put((None, -1, [], None))
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _nbytes(tensors: dict) -> int:
    return sum(t.nbytes for t in tensors.values())


def wait_until_up(urls: list[str], timeout_s: float) -> None:
    """Wait for every engine's `/models` to answer (engines another rank or job starts)."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while not answers(url):
            if time.monotonic() > deadline:
                raise EyasError(f"train.source=stream: the engine at {url} did not answer in {timeout_s:.0f} s; "
                                "start it with `eyas engine RECIPE` (or check train.stream_endpoints)")
            time.sleep(1.0)



def local_storage(recipe: Any) -> Path:
    """The folder engines write their files to and the trainers read them from (`train.stream_storage`)."""
    return Path(recipe.train.stream_storage) if recipe.train.stream_storage else recipe.run_dir / "stream" / "hidden"
