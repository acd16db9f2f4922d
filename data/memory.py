"""The dump's memory model: bytes per token on disk, and the memory a dump needs, per GPU and per host rank.

Counted from this stage's own code (`dump.py`'s batches and features, `shard_format.py`'s encodings), so it
lives beside it; `eyas plan` composes it with the trainer's and eval's, and the types it shares with
them are `eyas.memory`'s. Checked against measured peak memory by `benchmarks/bench_plan.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.data.dump import feature_spec
from eyas.data.shard_format import encode, ids_dtype
from eyas.draft.config import text_config
from eyas.memory import (
    CUDA_RUNTIME,
    GIB,
    Hardware,
    Need,
    Shapes,
    forward_bytes,
    smaller_budget_that_fits,
    target_bytes,
    with_setting,
)
from eyas.recipe_schema import Recipe

# Encoded batches of the dump alive on the host: the one just encoded and the one the shard writer
# thread is writing to its place in the file (data/dump.py `stream_rows`: one write in flight).
DUMP_BATCHES_IN_FLIGHT = 2
# A batch's prepared rows as Python lists (input_ids and loss_mask): a list slot of 8 bytes each,
# plus a 28-byte int object for ids past the 256 small ints Python caches.
ROW_BYTES_PER_TOKEN = 2 * 8 + 28
# vLLM's default share of each GPU it takes (the dump through vLLM does not change it).
VLLM_GPU_MEMORY_UTILIZATION = 0.9


def shard_bytes(recipe: Recipe, config: Any) -> dict[str, int]:
    """Bytes per token on disk, per stored feature: `feature_spec`'s features encoded as the dump encodes them.

    Each feature row is encoded once here (data/shard_format.py `encode`: fp8/int8 = 1 byte per value + a bf16
    scale per token and layer, int4 = half a byte + a scale per 32 values), plus the token id
    (`ids_dtype`) and the loss mask (1 byte). Per sample the shard adds 24 bytes (offset, prepared row, CRC).
    """
    spec = feature_spec(recipe, config)
    text = text_config(config)
    row = torch.zeros(1, int(text.hidden_size))
    out: dict[str, int] = {}
    for j, encoding in enumerate(spec["aux_encodings"]):
        out[f"aux_hidden.{j} ({encoding})"] = sum(t.nbytes for t in encode(row, encoding).values())
    if spec["last_hidden"]:
        out[f"last_hidden ({spec['last_encoding']})"] = sum(t.nbytes for t in encode(row, spec["last_encoding"]).values())
    id_bytes = torch.empty(0, dtype=ids_dtype(int(text.vocab_size))).element_size()
    if spec["topk"]:
        out[f"teacher top-{spec['topk']}"] = spec["topk"] * (2 + id_bytes)  # fp16 log-probabilities + ids
    out["input_ids"] = id_bytes
    out["loss_mask"] = 1
    return out


def dump_need(recipe: Recipe, config: Any, s: Shapes, hw: Hardware) -> Need:
    """Dump on one device: the target in its dtype b, one batch of N = max(dump.token_budget, data.max_length) tokens.

    device = weights (params·b) + max(forward, encode)
      forward = captured layers (distinct fused layers·N·H·b) + `forward_bytes`
      encode  = captured + last hidden and its selected copy (2·N·H·b) + one feature's encode buffers
                (N·H·(b + 4 + 4 + 1): its fp32 copy, |x| for the scale, the scaled values, the 1-byte codes)
      topk teacher: + 1024 positions x V x (b + 8) (`teacher_topk`'s chunk: logits, fp32 copy, logsumexp)
    host = the larger of
      loading: from_pretrained builds the weights on the CPU, then moves them (params·b; on a GPU only)
      running: DUMP_BATCHES_IN_FLIGHT encoded batches (N x `shard_bytes`) + the batch's prepared rows as
               Python lists (N x ROW_BYTES_PER_TOKEN); the shard itself streams to disk (`ShardWriter`)
    """
    if recipe.dump.backend == "vllm":
        return vllm_dump_need(recipe, config, s, hw)
    b = target_bytes(recipe, hw)
    n = max(recipe.dump.token_budget, recipe.data.max_length)
    spec = feature_spec(recipe, config)
    captured = len(set(spec["aux_layers"])) * n * s.hidden * b
    encode_buffers = n * s.hidden * (b + 4 + 4 + 1)
    teacher = 1024 * s.vocab * (b + 8) if spec["topk"] else 0
    device = {"weights": s.params * b,
              "activations": max(captured + forward_bytes(s, n, b), captured + 2 * n * s.hidden * b + encode_buffers)
              + teacher}
    host = {"loading": s.params * b} if hw.device == "cuda" else {}
    host["running"] = dump_batches_in_flight_bytes(recipe, config, n)
    if hw.device == "cuda":
        device["cuda runtime"] = CUDA_RUNTIME
    return Need("dump", device, host, "dump.token_budget", [f"batches of {n} tokens, weights {8 * b}-bit"])


def dump_batches_in_flight_bytes(recipe: Recipe, config: Any, n: int) -> float:
    """Host bytes of a dump running batches of n tokens, whatever its backend: DUMP_BATCHES_IN_FLIGHT encoded
    batches (n x `shard_bytes`) + the batch's prepared rows as Python lists (n x ROW_BYTES_PER_TOKEN)."""
    return n * (DUMP_BATCHES_IN_FLIGHT * sum(shard_bytes(recipe, config).values()) + ROW_BYTES_PER_TOKEN)


def vllm_dump_need(recipe: Recipe, config: Any, s: Shapes, hw: Hardware) -> Need:
    """Dump through a vLLM engine (`dump.backend: vllm`) over G = dump.vllm_tensor_parallel_size GPUs, per GPU:

    device = weights/G (tensor parallel shards every matrix; expert parallel spreads the experts instead:
             the same share) + the batch of N = max(dump.token_budget, data.max_length) tokens: `forward_bytes`/G
             (heads and MLP columns sharded) + its KV cache 2·L·Hkv·b·N/G + the extracted layers (N·H·b each,
             whole on every GPU) + vLLM's headroom (1 - gpu_memory_utilization of its 0.9 default: vLLM takes
             90% of each GPU and fills what the rest leaves with KV cache, so a need under the GPU's memory
             leaves it room)
    host = the encoded batches in flight, as the transformers dump (vLLM loads its shards straight to the GPUs)
    """
    b = target_bytes(recipe, hw)
    n = max(recipe.dump.token_budget, recipe.data.max_length)
    gpus = recipe.dump.vllm_tensor_parallel_size
    spec = feature_spec(recipe, config)
    kv = s.kv_heads * s.head_dim
    layers = set(spec["aux_layers"]) | ({s.layers} if spec["last_hidden"] else set())
    device = {"weights": s.params * b / gpus, "activations": forward_bytes(s, n, b) / gpus,
              "kv cache": 2 * s.layers * kv * b * n / gpus, "extracted layers": len(layers) * n * s.hidden * b}
    if hw.memory:
        device["vLLM headroom"] = (1 - VLLM_GPU_MEMORY_UTILIZATION) * hw.memory
    if hw.device == "cuda":
        device["cuda runtime"] = CUDA_RUNTIME
    host = {"running": dump_batches_in_flight_bytes(recipe, config, n)}
    how = "expert" if recipe.dump.vllm_expert_parallel else "tensor"
    return Need("dump", device, host, "dump.token_budget",
                [f"vLLM over {gpus} GPU(s) per dump task ({how} parallel), batches of {n} tokens, weights {8 * b}-bit"])


def dump_fits(recipe: Recipe, config: Any, s: Shapes, hw: Hardware, limit: float) -> list[str]:
    """What would make the dump fit in `limit` bytes per GPU, one line each: a smaller dump.token_budget, and
    on several GPUs a vLLM engine over some of them (not offered for a top-k teacher, which a vLLM dump
    does not store: the recipe refuses the pair)."""

    def total(changed: Recipe) -> float:
        return dump_need(changed, config, s, hw).device_total

    fits = []
    smaller = smaller_budget_that_fits(recipe, "dump", total, limit)
    if smaller:
        fits.append(f"dump.token_budget={smaller[0]} fits ({smaller[1] / GIB:.1f} GiB)")
    if recipe.dump.backend != "vllm" and hw.gpus > 1 and not feature_spec(recipe, config)["topk"]:
        for gpus in (g for g in (2, 4, 8) if g <= hw.gpus):
            sharded = total(with_setting(with_setting(recipe, "dump.backend", "vllm"), "dump.vllm_tensor_parallel_size", gpus))
            if sharded <= limit:
                fits.append(f"dump.backend=vllm dump.vllm_tensor_parallel_size={gpus} fits ({sharded / GIB:.1f} GiB per "
                            "GPU: a vLLM engine over that many GPUs per dump task)")
                break
    return fits
