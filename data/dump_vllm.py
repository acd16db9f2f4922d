"""`dump.backend: vllm`: the target's hidden states taken from a vLLM engine instead of a
transformers forward, for targets only an engine shards and runs fast (mixture-of-experts,
tensor and expert parallel).

`VllmCapture` keeps `HiddenCapture`'s contract (right-padded ids and their lengths in, the fused
layers and the last hidden state as [B, T, H] out), so the dump's plan, shards, encodings,
checksums and resume are the transformers dump's own. Inside it, vLLM's `extract_hidden_states`
speculative method caches the wanted layers of every prompt token, one 1-token generation per
sample, and a KV connector writes each request's [tokens, layers, H] to a safetensors file
under the shard folder, read back and removed batch by batch.

Layer ids are HF `hidden_states` indices, as `dump.layers` are: vLLM's id 0 is the embedding
output and id i the input of decoder layer i (the residual stream, = HF index i). Its id L is that
stream after the last layer *before* the final norm, while HF index L (and the stored
`last_hidden`) is the final-norm output, so the last layer's values go through the target's
final RMSNorm here (its weight read from the checkpoint). Measured on a tiny Llama in fp32:
every layer within 1.3e-7 of transformers', the normed last within 1.2e-6 (docs/stages.md).

The connector: vLLM 0.32's `ExampleHiddenStatesConnector` copies on a CUDA stream into pinned
memory, which a CPU build cannot do; `EyasHiddenStatesConnector` (built on first use, so this
module imports without vLLM) makes that copy and the write synchronously on the host, so a
request's file exists when vLLM reports it sent. vLLM writes a finished request's file at its
next engine step, so the capture steps the engine until every file of the batch is there.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.vllm_install import require_vllm

CONNECTOR = "EyasHiddenStatesConnector"
STAMP = "eyas_stamp"  # kv_connector_extra_config key: str -> str written into every file's safetensors metadata
# Engine steps after a batch's generations return before its files must all be written (one is
# enough in vLLM 0.32: the finished requests' saves go out with the next step's metadata).
FLUSH_STEPS = 8
CPU_KV_CACHE_GIB = 2
# The final norms this capture can apply to vLLM's pre-norm last layer: RMSNorm x * w (Llama,
# Qwen2/3, Mistral and their MoE variants). Gemma's (1 + w) and LayerNorm families are refused.
RMS_NORM_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral", "olmoe")


def __getattr__(name: str) -> Any:
    """vLLM looks the connector class up by name in this module (`kv_connector_module_path`)."""
    if name == CONNECTOR:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _connector_class() -> type:
    import fcntl

    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class Sent:
        """What the base class polls for a finished copy: here the copy and the write are already done."""

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            """Nothing to wait for: the write finished before this object was made."""

    class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
        """ExampleHiddenStatesConnector with the copy and write on the host, for CPU and GPU alike."""

        def _submit_async_write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten().to(self._kv_cache.device)
            hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).cpu().clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock = self._lock_fds.pop(pending.req_id, None)
            if lock is None and self.use_lock:
                lock = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename,
                          metadata=self._stamp())
            finally:
                if lock is not None:
                    os.close(lock)  # releases the reader waiting on the .lock file
            self._req_copy_events[pending.req_id] = Sent()

        def _stamp(self) -> dict[str, str]:
            """What every file says of where it came from: the layers this engine captures and, when the engine
            was started for an eyas recipe (`eyas engine`, a streamed run's own engines), that target's identity."""
            draft = self._vllm_config.speculative_config.draft_model_config.hf_config
            stamp = {"eyas_layer_ids": json.dumps(list(draft.eagle_aux_hidden_state_layer_ids))}
            stamp.update(self._kv_transfer_config.get_from_extra_config(STAMP, {}) or {})
            return stamp

    return EyasHiddenStatesConnector


def capture_layer_ids(aux_layers: list[int], need_last: bool, depth: int) -> list[int]:
    """The vLLM layer ids an engine captures for these HF `hidden_states` indices, in layer order (as vLLM stores
    them): the fused layers and, for the last hidden state, id `depth` (its pre-norm stream, normed here)."""
    wanted = set(aux_layers) | ({depth} if need_last else set())
    return sorted(min(i, depth) for i in wanted)


def capture_config(layer_ids: list[int], storage: Path, lock: bool, stamp: dict[str, str] | None = None) -> dict:
    """The engine arguments that make vLLM capture `layer_ids` of every prompt token into safetensors files under
    `storage` (`LLM(**...)` keywords; `vllm serve` takes the same two as JSON). `lock`: the connector holds a
    `.lock` file while it writes, so a reader in another process waits for the whole file (a server answers
    before the write); the dump reads in the engine's own process after the write. `stamp`: written into every
    file's metadata."""
    extra: dict[str, Any] = {"shared_storage_path": str(storage), "use_synchronization_lock": lock}
    if stamp:
        extra[STAMP] = dict(stamp)
    return {"speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
            "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_connector_module_path": __name__,
                                   "kv_role": "kv_producer", "kv_connector_extra_config": extra}}


def split_layers(stacked: torch.Tensor, layer_ids: list[int], aux_layers: list[int], depth: int,
                 norm: torch.nn.Module | None, need_last: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vLLM's captured `[..., len(layer_ids), H]` as `HiddenCapture` returns features: the fused layers in
    `aux_layers`' order and the last hidden state (the final-norm output of the last layer's stream)."""
    column = {layer: stacked[..., j, :] for j, layer in enumerate(layer_ids)}
    if norm is not None:
        column[depth] = norm(column[depth])
    aux = [column[min(i, depth)] for i in aux_layers]
    # without need_last the dump stores no last hidden state and never reads this one
    return aux, column[depth] if need_last else aux[-1]


def final_norm(config: Any, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The target's final norm: its family's own RMSNorm class from transformers (the families differ in
    where they cast back to the input's dtype), in `dtype`, with the weight read from its checkpoint."""
    import importlib

    from safetensors import safe_open

    family = config.model_type
    if family not in RMS_NORM_TYPES:
        raise EyasError(f"dump.backend=vllm: a '{family}' target's final norm is not one this dump applies "
                        f"(RMSNorm x * w: {', '.join(RMS_NORM_TYPES)}); use dump.backend=transformers")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm_class = next(v for k, v in vars(modeling).items() if k.endswith("RMSNorm") and isinstance(v, type))
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in ("model.norm.weight", "model.language_model.norm.weight"):
                if key in handle.keys():
                    norm = norm_class(int(config.hidden_size), eps=float(config.rms_norm_eps))
                    norm.weight.data = handle.get_tensor(key)
                    return norm.to(dtype)
    raise EyasError(f"dump.backend=vllm: no final norm weight (model.norm.weight) in the safetensors files of '{folder}'")


class VllmCapture:
    """`HiddenCapture` through a vLLM engine (see the module docstring).

    `aux_layers`: HF `hidden_states` indices of the fused layers; `need_last`: also return the
    final-norm output. `storage`: the folder the connector writes to (created, removed by close)."""

    model = None  # no transformers model: a top-k teacher needs its lm_head (refused at recipe load)

    def __init__(self, folder: Path, config: Any, dtype: torch.dtype, aux_layers: list[int], need_last: bool,
                 dump_cfg: Any, max_model_len: int, storage: Path, seed: int = 0) -> None:
        self.depth = int(config.num_hidden_layers)
        self.aux_layers, self.need_last = list(aux_layers), need_last
        self.layer_ids = capture_layer_ids(aux_layers, need_last, self.depth)
        self.norm = final_norm(config, folder, dtype) if self.depth in self.layer_ids else None
        self.storage = storage
        self.llm: Any = None  # started by the first batch: a dump with every shard done (a requeued task, the
        # finalize job) starts no engine
        self.engine_args = dict(
            model=str(folder), dtype=str(dtype).replace("torch.", ""), seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=int(dump_cfg.vllm_tensor_parallel_size),
            enable_expert_parallel=bool(dump_cfg.vllm_expert_parallel), enforce_eager=bool(dump_cfg.vllm_enforce_eager),
            # Every token computed in its own batch position, as the plan batches it: a cached prefix would be
            # the same values, but from another batch's arithmetic.
            enable_prefix_caching=False, max_num_batched_tokens=max(int(dump_cfg.token_budget), max_model_len),
            **capture_config(self.layer_ids, storage, lock=False),
        )

    def engine(self) -> Any:
        """The vLLM engine, started on first use."""
        if self.llm is None:
            from vllm import LLM

            shutil.rmtree(self.storage, ignore_errors=True)
            self.storage.mkdir(parents=True)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its steps are ours to drive
            if not torch.cuda.is_available():
                # vLLM's CPU backend otherwise reserves 92% of host memory; a 1-token generation per sample needs
                # cache for one batch (VLLM_CPU_KVCACHE_SPACE, GiB, as set by the user wins)
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
            self.llm = LLM(**self.engine_args)
        return self.llm

    def __call__(self, input_ids: torch.Tensor, lengths: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        from safetensors.torch import load_file
        from vllm import SamplingParams

        rows = [input_ids[b, :int(n)].tolist() for b, n in enumerate(lengths)]
        outputs = self.engine().generate([{"prompt_token_ids": ids} for ids in rows],
                                    SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        paths = [Path(out.kv_transfer_params["hidden_states_path"]) for out in outputs]
        for _ in range(FLUSH_STEPS):
            if all(p.is_file() for p in paths):
                break
            self.llm.llm_engine.step()
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise EyasError(f"dump.backend=vllm: vLLM wrote no hidden states for {len(missing)} of {len(paths)} samples "
                            f"after {FLUSH_STEPS} engine steps (first: {missing[0]})")
        stacked: torch.Tensor | None = None
        for b, (ids, path) in enumerate(zip(rows, paths)):
            saved = load_file(str(path))
            path.unlink()
            if saved["token_ids"].tolist() != ids:
                raise EyasError(f"dump.backend=vllm: the hidden states in {path} belong to other tokens than the sample's")
            states = saved["hidden_states"]  # [T, layers, H]
            if stacked is None:
                stacked = states.new_zeros(len(rows), input_ids.shape[1], len(self.layer_ids), states.shape[-1])
            stacked[b, :len(ids)] = states
        assert stacked is not None
        return split_layers(stacked, self.layer_ids, self.aux_layers, self.depth, self.norm, self.need_last)

    def close(self) -> None:
        import gc

        self.llm = None
        gc.collect()
        shutil.rmtree(self.storage, ignore_errors=True)


def vllm_version() -> str:
    """The installed vLLM (the manifest records it); one line with the install command when there is none."""
    import sys

    try:
        return require_vllm(sys.executable)  # the engine runs in this process
    except EyasError as exc:
        raise EyasError(f"dump.backend=vllm: {exc}") from None
