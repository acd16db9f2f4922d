"""`eyas plan RECIPE`: GPU memory, host memory, shard bytes and optimizer steps of each stage, before anything runs.

Everything comes from the recipe and the target's `config.json` alone: no weights are loaded
(parameters are counted on accelerate's empty-weights device), so the plan of an 8B recipe runs
on a laptop with the 8B config downloaded alone (`--target-config`). Per stage it prints the
memory per GPU, split into named parts (weights, optimizer state, activations, KV cache, ...),
the memory per host rank, the dump's bytes per token on disk, the optimizer steps, and for the
GPU named (`--gpu h100-80gb --gpus 8`) what does not fit and what would ("train.token_budget=65536
needs 206.0 GiB > 79.6 GiB (h100-80gb); train.token_budget=16384 fits (62.2 GiB, ...)").

The model is a few named functions below, each with its formula. Its parts were counted tensor by
tensor from the code they describe (which tensors autograd keeps, which copies a cast makes) and the
whole was checked against measured peak memory by `benchmarks/bench_plan.py` (docs/results.md,
"Plan"). Not modelled: the caching allocator's fragmentation on a GPU and the Python process itself
(about 1 GiB of host memory per rank before anything loads).

`refuse_if_too_big` is the same model as a check the stages call: training on CUDA refuses a recipe
whose need exceeds the GPU by more than the model's measured error, before loading the target.

This module reads every stage's settings and code (the dump's features, the trainer's batches), so
it is front-door code like `eyas.stages`: it imports the data stage and the trainer's loader, and the
eval stage only inside the function that plans eval (training imports this module for its check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eyas.cli import guarded
from eyas.config import Recipe, load_recipe
from eyas.data.dump import feature_spec, manifest_features, sample_lengths
from eyas.data.prepare import load_prepared
from eyas.data.shards import encode, ids_dtype
from eyas.draft.config import target_shapes, text_config
from eyas.draft.features import FUSED_LAYERS, LAST_HIDDEN
from eyas.draft.head import DraftHead
from eyas.draft.registry import build_head, head_class, uses_draft_vocab
from eyas.errors import EyasError, UnsupportedTarget
from eyas.precision import mixed_precision_for
from eyas.targets import check_layer_kinds, load_target_config
from eyas.train.loader import TokenBudgetLoader

GIB = float(1 << 30)
MIB = 1 << 20

# Total memory of common GPUs, in MiB as `nvidia-smi` reports it (the same figure, in bytes, as
# torch.cuda.get_device_properties(i).total_memory): a card sold as "80GB" holds about 79.6 GiB.
GPUS: dict[str, int] = {
    "a10g-24gb": 23028,
    "l4-24gb": 23034,
    "rtx4090-24gb": 24564,
    "a100-40gb": 40960,
    "l40s-48gb": 46068,
    "rtx6000ada-48gb": 49140,
    "a100-80gb": 81920,
    "h100-80gb": 81559,
    "h200-141gb": 143771,
    "b200-180gb": 183359,
}
# Memory a CUDA process holds outside torch's tensors: the CUDA context, cuBLAS workspaces and NCCL
# buffers (about 0.5-1 GiB per process on A100/H100: nvidia-smi's figure minus
# torch.cuda.memory_reserved). An assumption: eyas has not run on a GPU yet.
CUDA_RUNTIME = 1 << 30
# A recipe is refused only when its need exceeds the GPU by more than the model's measured error
# (benchmarks/bench_plan.py: |measured/predicted - 1| <= 0.15), so a recipe at the edge is tried.
REFUSE_MARGIN = 1.15
# Encoded batches of the dump alive on the host: the one just encoded and the one the shard writer
# thread is writing to its place in the file (data/dump.py `stream_rows`: one write in flight).
DUMP_BATCHES_IN_FLIGHT = 2
# A batch's prepared rows as Python lists (input_ids and loss_mask): a list slot of 8 bytes each,
# plus a 28-byte int object for ids past the 256 small ints Python caches.
ROW_BYTES_PER_TOKEN = 2 * 8 + 28
# vLLM's default share of each GPU it takes (the dump through vLLM does not change it).
VLLM_GPU_MEMORY_UTILIZATION = 0.9


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Hardware:
    """Where a stage runs: `device` cuda or cpu, memory per device (None: unknown), processes."""

    device: str = "cuda"
    memory: int | None = None
    gpus: int = 1
    name: str = "GPU"


@dataclass(frozen=True)
class Precision:
    """Bytes of what a training step stores: `params` the module's weights, `residual` the draft's residual
    stream and normalised activations, `activation` matmul outputs; `casts`: autocast casts each Linear's
    input on its own (q, k, v -> 3 copies) and keeps half copies of the trainable weights."""

    name: str
    mixed: str  # accelerate's mixed_precision: no, bf16 or fp16
    params: int
    residual: int
    activation: int
    casts: bool


@dataclass(frozen=True)
class Shapes:
    """The target's sizes that every formula uses."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    mlp_width: int = 0  # the MLP width one token runs through in the target (a MoE's routed experts together)


@dataclass(frozen=True)
class DraftSize:
    """The draft head's parameters and the layout of one draft step, from a head built without weights."""

    trainable: int
    frozen: int
    largest_trainable: int
    largest: int
    largest_shared: int  # largest trainable tensor every unrolled step uses (eagle3's lm_head), 0 if none
    draft_vocab: int
    norms: int          # RMSNorms one draft step runs (its layer's and the final one)
    embedding_norms: int  # of those, the ones over the token embedding (no gradient flows into it)
    attention_in: int   # width q, k, v read (2H for eagle3's concat(embedding, feature))
    extra_in: int       # inputs of the step's other projections (mtp's eh_proj: 2H)
    projection_in: int  # input of the once-per-unroll feature projection (eagle3's fc: 3H), 0 if none
    frozen_matmul: int  # parameters of frozen Linear layers a step runs (mtp's and EAGLE-1's lm_head)


@dataclass
class Need:
    """One stage's memory: named parts per device (summed) and host phases per rank (the largest counts),
    in bytes, and the setting that scales it."""

    stage: str
    device: dict[str, float]
    host: dict[str, float]
    knob: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return max(self.host.values(), default=0.0)


def read_config(recipe: Recipe, target_config: str | None = None) -> Any:
    """The target's transformers config: `--target-config` (a config.json or its folder), else target.path."""
    if target_config is None:
        try:
            return load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
        except UnsupportedTarget:
            raise
        except EyasError as exc:
            raise EyasError(f"cannot read the target's config ({exc}); give it with --target-config PATH_OR_DIR: a "
                            "config.json alone is enough, e.g. huggingface-cli download meta-llama/Llama-3.1-8B-Instruct "
                            "config.json --local-dir DIR") from None
    path = Path(target_config).expanduser()
    if path.is_file():
        from transformers import AutoConfig

        try:
            data = json.loads(path.read_text())
            config = AutoConfig.for_model(data.pop("model_type"), **data)
        except (OSError, ValueError, KeyError) as exc:
            raise EyasError(f"--target-config '{path}' is not a readable model config.json ({exc})") from None
        check_layer_kinds(config, f"--target-config '{path}'")
        return config
    if not (path / "config.json").is_file():
        raise EyasError(f"--target-config '{path}' is neither a config.json nor a folder holding one")
    return load_target_config(str(path), trust_remote_code=recipe.target.trust_remote_code)


def shapes_of(config: Any) -> Shapes:
    """The target's sizes; its parameter count from the model class built on the empty-weights device."""
    s = target_shapes(config)
    shapes = Shapes(hidden=s["hidden_size"], layers=int(text_config(config).num_hidden_layers),
                    heads=s["num_attention_heads"], kv_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
                    intermediate=s["intermediate_size"], vocab=s["vocab_size"], params=0,
                    mlp_width=mlp_width(text_config(config)))
    return dataclasses.replace(shapes, params=_target_params(config, shapes, s["tie_word_embeddings"]))


def mlp_width(text: Any) -> int:
    """The intermediate width one token runs through in a target layer: intermediate_size for a dense MLP;
    for a mixture of experts, its routed experts' widths together plus any shared expert (Qwen3-MoE:
    8 x 768, gpt-oss: 4 x 2880, DeepSeek: 8 x 2048 + one shared of 2048)."""
    routed = int(getattr(text, "num_experts_per_tok", 0) or 0)
    experts = max(int(getattr(text, name, 0) or 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if not (routed and experts):
        return int(text.intermediate_size)
    expert = int(getattr(text, "moe_intermediate_size", 0) or text.intermediate_size)
    shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0) \
        or int(getattr(text, "n_shared_experts", 0) or 0) * expert
    return routed * expert + shared


def _target_params(config: Any, s: Shapes, tied: bool) -> int:
    """Parameters of the target's own class, counted without memory; a class transformers cannot build from
    the config alone (its code lives in the model's folder) is counted as a Llama-like layout:
    embedding (+ lm_head unless tied) + per layer q, k, v, o, the gated MLP and two norms + the final norm."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights():
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except (ValueError, ImportError, KeyError, TypeError):
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        layer = s.hidden * (2 * q + 2 * kv) + 3 * s.hidden * s.intermediate + 2 * s.hidden
        return s.vocab * s.hidden * (1 if tied else 2) + s.layers * layer + s.hidden


def draft_size(recipe: Recipe, config: Any) -> DraftSize:
    """The draft's parameters, counted on a head built on the empty-weights device from the recipe and config."""
    from accelerate import init_empty_weights

    vocab = int(text_config(config).vocab_size)
    d2t = None
    if uses_draft_vocab(recipe.draft) and 0 < recipe.dump.draft_vocab_size < vocab:
        d2t = torch.zeros(recipe.dump.draft_vocab_size, dtype=torch.long)  # maps draft id i to target id i
    with init_empty_weights():
        head = build_head(recipe.draft, config, list(recipe.dump.layers) or None, d2t)
    params = [p for _, p in head.named_parameters()]
    trainable = [p for p in params if p.requires_grad]
    blocks = [m for m in head.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
    block = blocks[0]
    in_blocks = {id(p) for layer in blocks for p in layer.parameters()}
    projection = {id(p) for p in getattr(head, "fc", torch.nn.Module()).parameters()}
    # weights every step uses (a shared layer, and the lm_head and final norm outside the layers): their
    # gradients accumulate over the steps
    shared = [p for p in trainable if id(p) not in projection and (head.shares_layer or id(p) not in in_blocks)]
    hidden = head.config.hidden_size
    extra_in = sum(m.in_features for n, m in block.named_modules()
                   if isinstance(m, torch.nn.Linear) and not n.startswith(("self_attn", "mlp")))
    # a layer that reads concat(norm(embedding), norm(feature)) (eagle3's attention, mtp's eh_proj) runs one
    # norm over the token embedding; EAGLE-1 concatenates the raw embedding
    embedding_norms = int(2 * hidden in (block.self_attn.q_proj.in_features, extra_in))
    return DraftSize(
        trainable=sum(p.numel() for p in trainable), frozen=sum(p.numel() for p in params if not p.requires_grad),
        largest_trainable=max(p.numel() for p in trainable), largest=max(p.numel() for p in params),
        largest_shared=max((p.numel() for p in shared), default=0),
        draft_vocab=head.config.draft_vocab_size, norms=_step_norms(head, blocks), embedding_norms=embedding_norms,
        attention_in=block.self_attn.q_proj.in_features, extra_in=extra_in,
        projection_in=head.fc.in_features if isinstance(getattr(head, "fc", None), torch.nn.Linear) else 0,
        frozen_matmul=sum(m.weight.numel() for m in head.modules()
                          if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad))


def _step_norms(head: DraftHead, blocks: list[torch.nn.Module]) -> int:
    """RMSNorms of one draft step: those of its layer, and a final norm outside the layers (eagle3's `norm`)."""
    inside = {id(m) for layer in blocks for m in layer.modules()}
    norms = sum(1 for m in blocks[0].modules() if isinstance(m, LlamaRMSNorm))
    return norms + (1 if any(id(m) not in inside for m in head._final_norms()) else 0)


def precision_of(recipe: Recipe, hw: Hardware, sharding: str, mixed: str | None = None) -> Precision:
    """What a training step stores, from train.mixed_precision (or accelerate's resolved `mixed`) and the sharding.

    fp32: everything 4 bytes. Half precision under DDP (and a single process): accelerate's autocast,
    fp32 weights, half matmul outputs; the draft's residual stream stays fp32 (its feature is cast to the
    fp32 embedding's dtype). Under DeepSpeed and FSDP the module itself computes in half precision.
    """
    if mixed is None:
        mixed = mixed_precision_for(recipe.train.mixed_precision, hw.device) if hw.device == "cpu" else \
            {"auto": "bf16", "fp32": "no"}.get(recipe.train.mixed_precision, recipe.train.mixed_precision)
    if mixed == "no":
        return Precision("fp32", mixed, 4, 4, 4, False)
    if sharding in ("zero2", "zero3", "fsdp"):
        return Precision(f"{mixed} weights", mixed, 2, 2, 2, False)
    return Precision(f"{mixed} autocast", mixed, 4, 4, 2, True)


def target_bytes(recipe: Recipe, hw: Hardware) -> int:
    """Bytes per target weight: target.dtype (auto: bf16 on a GPU, fp32 on a CPU)."""
    dtype = recipe.target.dtype
    if dtype == "auto":
        return 2 if hw.device == "cuda" else 4
    return 4 if dtype == "float32" else 2


# ----------------------------------------------------------------------------- the model


def forward_bytes(s: Shapes, tokens: int, dtype_bytes: int) -> float:
    """Largest working set of one target decoder layer in inference, for `tokens` tokens.

    MLP: the residual and its normalised copy (2H), then act(gate), up and their product alive at once
    (3I, I the width a token runs through: `mlp_width`); attention: residual, normalised, q, its RoPE copy
    and the output (2H + 3·Hq) plus k, v and k's RoPE copy (3·Hkv). The larger of the two, times tokens x
    dtype bytes.
    """
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    width = s.mlp_width or s.intermediate
    return tokens * dtype_bytes * max(2 * s.hidden + 3 * width, 2 * s.hidden + 3 * q + 3 * kv)


def shard_bytes(recipe: Recipe, config: Any) -> dict[str, int]:
    """Bytes per token on disk, per stored feature: `feature_spec`'s features encoded as the dump encodes them.

    Each feature row is encoded once here (data/shards.py `encode`: fp8/int8 = 1 byte per value + a bf16
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


def ttt_step_bytes(s: Shapes, d: DraftSize, p: Precision) -> float:
    """Activations autograd keeps for one unrolled draft step, per token (bytes).

    Counted from the step's code (eyas/draft/blocks.py, train/losses.py), with H hidden, Hq = heads·d,
    Hkv = kv heads·d, I intermediate, V' the draft vocabulary, r/a from `Precision`:
      norms        n_norm x (4·H + 4): each RMSNorm's fp32 x·rsqrt(var) and rsqrt; with half weights
                   6·H + 4 (its fp32 copy of the input and the half normalised value), except 2·H + 4 for a
                   norm over the token embedding (which needs no gradient)
      residual     2·H·4: the stream after attention and the step's output (norm inputs), when the stream
                   is fp32 (a half stream is kept only as the norms' fp32 copies above)
      linear ins   what q/k/v, gate/up, lm_head and the step's other projections read (W_attn, H, H,
                   W_extra): under autocast one half cast per Linear, a·(3·W_attn + 2·H + H + W_extra);
                   otherwise the tensors themselves, r·(W_attn + H + H + W_extra)
      attention    a·(2·Hq + 2·Hkv) + 4·heads: q, k, v, the output and the fp32 log-sum-exp (a fused,
                   linear-memory kernel; no [T, T] scores)
      RoPE         2·d·r: cos and sin at the step's positions
      MLP          4·I·a: gate, act(gate), up, act·up
      logits       V'·a + 4: the draft logits and soft cross-entropy's log-sum-exp
    """
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    norms = d.norms * ((6 if p.params == 2 else 4) * h + 4) - (4 * h * d.embedding_norms if p.params == 2 else 0)
    residual = 2 * h * 4 if p.residual == 4 else 0
    if p.casts:
        ins = (3 * d.attention_in + 2 * h + h + d.extra_in) * p.activation
    else:
        ins = (d.attention_in + h + h + d.extra_in) * p.residual
    attention = p.activation * (2 * q + 2 * kv) + 4 * s.heads
    return (norms + residual + ins + attention + 2 * s.head_dim * p.residual + 4 * s.intermediate * p.activation
            + d.draft_vocab * p.activation + 4)


def unroll_bytes(s: Shapes, d: DraftSize, p: Precision, steps: int, tokens: int, seq: int, recompute: bool,
                 dense: bool) -> float:
    """Activations of an unroll of K = `steps` steps over N = `tokens` tokens (bytes), sequences of up to `seq`.

    kept      K x N x `ttt_step_bytes`, plus what the fused attention (eyas/draft/ttt_attention.py) adds
              per step k: the merged probabilities of its k earlier steps (4·heads·k), N x K(K-1)/2 x 4·heads
              in all; under autocast, per step, the half copy of its key that the TTT cache keeps (RoPE
              leaves keys in fp32), N x K x a·Hkv; and under autocast, per step, a half copy of each
              frozen matrix it multiplies by (autocast caches only trainable weights): K x 2 x frozen_matmul
    train.checkpoint_unroll: every step is recomputed in the backward, so the unroll keeps per step its
              inputs and outputs only, N x (H·r + Hkv·(r + a) + 16: the hidden fed on, its key and value,
              drafted ids and positions), and one step's full activations while that step is recomputed
    dense     fp32 on a GPU (CUDA's flash kernel takes bf16/fp16 only; the dense reference runs instead):
              steps k >= 1 keep their [B, heads, T, T + k] fp32 probabilities, heads·T·4 per token,
              T = the longest sequence
    """
    h, kv = s.hidden, s.kv_heads * s.head_dim
    per_step = ttt_step_bytes(s, d, p)
    if recompute:
        kept = steps * (h * p.residual + kv * (p.residual + p.activation) + 16) + per_step
    else:
        kept = steps * per_step + steps * (steps - 1) / 2 * 4 * s.heads + (steps * p.activation * kv if p.casts else 0)
    scores = (steps - 1) * s.heads * seq * 4 if dense else 0
    frozen_casts = steps * 2 * d.frozen_matmul if p.casts else 0
    return tokens * (kept + scores) + frozen_casts


def projection_bytes(s: Shapes, d: DraftSize, p: Precision, tokens: int, feature_width: int) -> float:
    """What the once-per-unroll feature projection (eagle3's fc over the fused layers) keeps, for N tokens.

    Its input: a half copy, N·W·2, in half precision; in fp32 nothing new when it reads the batch's
    dumped feature itself (W = the feature's width), else its fp32 input N·W·4 (EAGLE-1's concat).
    Its output, the step-0 feature, N·H·4 when the residual stream is fp32 (else in the first norm).
    """
    if not d.projection_in:
        return 0.0
    w = d.projection_in
    kept_input = w * 2 if p.activation == 2 else (w * 4 if w != feature_width else 0)
    return tokens * (kept_input + (s.hidden * 4 if p.residual == 4 else 0))


def optimizer_need(d: DraftSize, p: Precision, sharding: str, gpus: int, device: str) -> dict[str, float]:
    """Weights, gradients and AdamW state per device (P trainable, F frozen draft parameters, N gpus).

    ddp (and one process): weights 4·(P + F), gradients 4·P, AdamW m and v 8·P; with N > 1 DDP's
      gradient buckets 4·P; autocast's half copies of the trainable weights 2·P.
    zero2 (DeepSpeed, half weights): weights 2·(P + F), gradients 2·P/N, fp32 master + m + v 12·P/N
      (the ZeRO paper's 2 + 2 + 12 bytes, the last two terms sharded); in fp32: 4·(P + F) + 4·P/N + 8·P/N.
    zero3: every term / N, plus the largest parameter gathered whole.
    fsdp (FSDP2, one unit): fp32 shards 4·(P + F)/N, gradients 4·P/N, m and v 8·P/N, and the whole model
      gathered in half precision while it runs, 2·(P + F), with its half gradients 2·P.
    The optimizer step's own buffers: torch's AdamW on a GPU (foreach) one fp32 copy of the (local) state,
    4·P(/N); on a CPU (per tensor) sqrt and the denominator of the largest tensor, 8·largest.
    """
    P, F, N = d.trainable, d.frozen, max(1, gpus)
    w = p.params
    if sharding == "zero2":
        parts = {"weights": w * (P + F), "gradients": w * P / N, "optimizer state": (12 if w == 2 else 8) * P / N}
    elif sharding == "zero3":
        parts = {"weights": w * (P + F) / N + w * d.largest, "gradients": w * P / N,
                 "optimizer state": (12 if w == 2 else 8) * P / N}
    elif sharding == "fsdp":
        parts = {"weights": 4 * (P + F) / N + (2 * (P + F) if w == 2 else 0),
                 "gradients": 4 * P / N + (2 * P if w == 2 else 0), "optimizer state": 8 * P / N}
    else:
        parts = {"weights": 4 * (P + F) + (2 * P if p.casts else 0), "gradients": 4 * P + (4 * P if N > 1 else 0),
                 "optimizer state": 8 * P}
    local = P / N if sharding != "ddp" else P
    parts["optimizer step buffers"] = 4 * local if device == "cuda" else 8 * d.largest_trainable
    return parts


def train_need(recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware, sharding: str = "ddp",
               mixed: str | None = None) -> Need:
    """Training on one device, steady state (the optimizer state exists), N = max(train.token_budget, data.max_length).

    device = `optimizer_need`
           + teacher lm_head: the target's, all V rows (the draft rows and the rest, for the held-out argmax),
             V·H x (2 under bf16 on a GPU, else 4)
           + batch: N x (4 x the dumped feature widths, decoded on the device + 8 ids + 4 loss mask + 8
             attention mask; a top-k teacher 12·k)
           + teacher distribution: N x (4·V' probabilities + 4 sum p log p + 8 argmax)
           + activations: `unroll_bytes` (K = train.ttt_steps; 1 for EAGLE-1) + `projection_bytes`
           + backward buffers: the largest of soft cross-entropy's two fp32 [N, V'] buffers (N·8·V'), the
             MLP's gradients (N·4·I·a), with the dense attention its two further [T, T] score tensors, and,
             when K > 1 steps share a weight, its gradient accumulation: the second step's contribution to
             the largest shared tensor is a temporary of its size (w·largest_shared, w the weights' bytes)
             beside that step's loss gradient (N·4·V'), once the last step's activations are freed
           + train.source=online: the target (params x its dtype) and one forward (`forward_bytes` + captures)
    host = the larger of
      init (on a GPU): the target's embedding and lm_head read in fp32 (2·V·H·4) + the head built on the
             CPU in fp32 (4·(P + F)) (+ online, the target itself, params x its dtype); on a CPU these
             copies are gone before the first step
      running: batches of stored codes (`shard_bytes` + 10 per token: ids widened, attention mask; online,
             ids, loss and attention masks) read ahead, train.prefetch per loader worker (or by one thread),
             plus the one in use and one being padded; each loader worker is a process of its own besides
    """
    p = precision_of(recipe, hw, sharding, mixed)
    cfg = recipe.train
    n = max(cfg.token_budget, recipe.data.max_length)
    steps = 1 if head_class(recipe.draft.kind).feature_regression else cfg.ttt_steps
    spec = feature_spec(recipe, config)
    features = manifest_features(spec, s.hidden)
    widths = sum(int(f["shape"][0]) for name, f in features.items() if name in (FUSED_LAYERS.name, LAST_HIDDEN.name))
    batch = n * (4 * widths + spec["topk"] * (4 + 8) + 8 + 4 + 8)
    project = projection_bytes(s, d, p, n, int(features[head_class(recipe.draft.kind).feature]["shape"][0]))
    dense = hw.device == "cuda" and p.activation == 4 and steps > 1
    device = dict(optimizer_need(d, p, sharding, hw.gpus, hw.device))
    device["teacher lm_head"] = s.vocab * s.hidden * (2 if hw.device == "cuda" and p.mixed == "bf16" else 4)
    device["batch"] = batch
    device["teacher distribution"] = n * (4 * d.draft_vocab + 4 + 8)
    device["activations"] = unroll_bytes(s, d, p, steps, n, recipe.data.max_length, cfg.checkpoint_unroll, dense) + project
    accumulate = p.params * d.largest_shared + n * (4 * d.draft_vocab - ttt_step_bytes(s, d, p)) if steps > 1 else 0
    device["backward buffers"] = max(n * 8 * d.draft_vocab, n * 4 * s.intermediate * p.activation, accumulate,
                                     n * 2 * s.heads * recipe.data.max_length * 4 if dense else 0)
    if cfg.source == "online":
        b = target_bytes(recipe, hw)
        captured = max(1, len(set(spec["aux_layers"]))) * n * s.hidden * b
        device["target (online)"] = s.params * b + captured + forward_bytes(s, n, b)
    ahead = cfg.prefetch * max(1, cfg.loader_workers) + 2
    online = s.params * target_bytes(recipe, hw) if cfg.source == "online" else 0  # the target loads on the CPU first
    host = {"init": 2 * s.vocab * s.hidden * 4 + 4 * (d.trainable + d.frozen) + online} if hw.device == "cuda" else {}
    read = 8 + 4 + 8 if cfg.source == "online" else sum(shard_bytes(recipe, config).values()) + 10  # online: tokens only
    host["running"] = ahead * n * read
    if hw.device == "cuda":
        device["cuda runtime"] = CUDA_RUNTIME
    notes = [f"{p.name}, {sharding}, {steps} unrolled step(s) of {n} tokens"
             + (", recomputed in the backward" if cfg.checkpoint_unroll else "")
             + (", dense [T, T] attention (fp32 on a GPU)" if dense else "")]
    return Need("train", device, host, "train.token_budget", notes)


def eval_need(recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware) -> Need:
    """Eval on one device, one prompt at a time: the target and the draft in the target's dtype b.

    device = weights (params + draft params)·b
           + KV cache 2·L·Hkv·b x C, C = data.max_length (a prompt's bound) + eval.max_new_tokens + the
             largest tree of eval.shapes + 1
           + the prompt's prefill, P = data.max_length tokens: `forward_bytes`, the logits P·V·b and every
             layer's hidden state (L + 1)·P·H·b (kept for drafts that read the target's features)
    host: loading, the weights on the CPU first (params·b; on a GPU only)
    """
    # the eval stage's own shape parser, imported here only so that training (which imports this module) does not load eval
    from eyas.eval.tree import parse_shape

    b = target_bytes(recipe, hw)
    prompt = recipe.data.max_length
    nodes = max(parse_shape(shape).max_nodes for shape in recipe.eval.shapes)
    context = prompt + recipe.eval.max_new_tokens + nodes + 1
    kv = s.kv_heads * s.head_dim
    device = {"weights": (s.params + d.trainable + d.frozen) * b, "kv cache": 2 * s.layers * kv * b * context,
              "prefill": forward_bytes(s, prompt, b) + prompt * s.vocab * b + (s.layers + 1) * prompt * s.hidden * b}
    host = {}
    if hw.device == "cuda":
        device["cuda runtime"] = CUDA_RUNTIME
        host["loading"] = s.params * b
    return Need("eval", device, host, "data.max_length", [f"one prompt at a time, context up to {context} tokens"])


# ----------------------------------------------------------------------------- steps


class _Lengths:
    """What TokenBudgetLoader reads to plan its batches: the sample lengths."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)


def prepared_lengths(recipe: Recipe) -> dict[str, np.ndarray] | None:
    """Sample lengths of the prepared splits, or None when `runs/<name>/prepared` does not exist yet."""
    if not (recipe.run_dir / "prepared" / "train" / "dataset_info.json").is_file():
        return None
    out = {"train": sample_lengths(load_prepared(recipe.run_dir, "train"))}
    if (recipe.run_dir / "prepared" / "heldout" / "dataset_info.json").is_file():
        out["heldout"] = sample_lengths(load_prepared(recipe.run_dir, "heldout"))
    return out


def optimizer_steps(recipe: Recipe, gpus: int, lengths: np.ndarray | None, tokens: int | None) -> tuple[int | None, str]:
    """(steps, how they were counted): the trainer's own count from the prepared lengths, else estimated from tokens.

    With the prepared data: ceil(epochs x batches per process / grad_accum), the batches exactly as
    `TokenBudgetLoader` deals them to `gpus` processes. From a token count: at least
    ceil(epochs x tokens / (gpus x grad_accum x train.token_budget)) (batches are never fuller than the budget).
    """
    cfg = recipe.train
    if cfg.max_steps:
        return cfg.max_steps, "train.max_steps"
    if lengths is not None:
        batches = len(TokenBudgetLoader(_Lengths(lengths), cfg.token_budget, seed=recipe.run.seed, world_size=gpus,
                                        grad_accum=cfg.grad_accum))
        steps = max(1, math.ceil(cfg.epochs * batches / cfg.grad_accum))
        return steps, (f"{cfg.epochs:g} epochs x {batches:,} batches per GPU / grad_accum {cfg.grad_accum}, "
                       f"from {recipe.run_dir / 'prepared'}")
    if tokens:
        steps = math.ceil(cfg.epochs * tokens / (gpus * cfg.grad_accum * cfg.token_budget))
        return steps, f"at least: {cfg.epochs:g} epochs x {tokens:,} tokens / ({gpus} x {cfg.grad_accum} x {cfg.token_budget})"
    return None, "unknown: run `eyas prepare` first or pass --tokens N"


# ----------------------------------------------------------------------------- fitting


def with_setting(recipe: Recipe, key: str, value: Any) -> Recipe:
    """A copy of the recipe with `section.key` set (no validation: the fit search only lowers a budget)."""
    section, name = key.split(".")
    return dataclasses.replace(recipe, **{section: dataclasses.replace(getattr(recipe, section), **{name: value})})


def stage_need(stage: str, recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware,
               sharding: str = "ddp", mixed: str | None = None) -> Need:
    if stage == "dump":
        return dump_need(recipe, config, s, hw)
    if stage == "train":
        return train_need(recipe, config, s, d, hw, sharding, mixed)
    return eval_need(recipe, config, s, d, hw)


# Sharding that holds less per GPU than the one in use, in the order to try.
LESS_PER_GPU = {"ddp": ("zero2", "zero3"), "zero2": ("zero3",), "zero3": (), "fsdp": ()}


def fit_advice(stage: str, recipe: Recipe, config: Any, hw: Hardware, sharding: str = "ddp", mixed: str | None = None,
               limit: float | None = None, sizes: tuple[Shapes, DraftSize] | None = None) -> str | None:
    """None if the stage fits in `limit` bytes (default: the GPU's memory), else one line: the setting, its
    need, and what would fit.

    Tried: the stage's token budget halved down to data.max_length (a longer sample is a batch of its
    own, so no budget goes below it; for training with grad_accum raised to keep the tokens per step),
    and for training, recomputing the unroll (train.checkpoint_unroll) and sharding the optimizer state
    over several GPUs, each at the recipe's own budget.
    """
    limit = hw.memory if limit is None else limit
    s, d = sizes or (shapes_of(config), draft_size(recipe, config))

    def total(changed: Recipe, how: str = sharding) -> float:
        return stage_need(stage, changed, config, s, d, hw, how, mixed).device_total

    need = stage_need(stage, recipe, config, s, d, hw, sharding, mixed)
    if limit is None or need.device_total <= limit:
        return None
    fits = []
    if stage in ("dump", "train"):
        budget = getattr(recipe, stage).token_budget
        for value in _smaller_budgets(budget, recipe.data.max_length):
            smaller = total(with_setting(recipe, f"{stage}.token_budget", value))
            if smaller <= limit:
                accum = f", with train.grad_accum={recipe.train.grad_accum * budget // value} for the same tokens per " \
                        "step" if stage == "train" and budget % value == 0 else ""
                fits.append(f"{stage}.token_budget={value} fits ({smaller / GIB:.1f} GiB{accum})")
                break
    # a vLLM dump stores no top-k teacher (the recipe refuses the pair): not offered for one
    if stage == "dump" and recipe.dump.backend != "vllm" and hw.gpus > 1 and not feature_spec(recipe, config)["topk"]:
        for gpus in (g for g in (2, 4, 8) if g <= hw.gpus):
            engine = with_setting(with_setting(recipe, "dump.backend", "vllm"), "dump.vllm_tensor_parallel_size", gpus)
            sharded = total(engine)
            if sharded <= limit:
                fits.append(f"dump.backend=vllm dump.vllm_tensor_parallel_size={gpus} fits ({sharded / GIB:.1f} GiB per "
                            "GPU: a vLLM engine over that many GPUs per dump task)")
                break
    if stage == "train" and not recipe.train.checkpoint_unroll:
        recomputed = total(with_setting(recipe, "train.checkpoint_unroll", True))
        if recomputed <= limit:
            fits.append(f"train.checkpoint_unroll=true fits ({recomputed / GIB:.1f} GiB, one more forward per step)")
    if stage == "train" and hw.gpus > 1:
        for other in LESS_PER_GPU[sharding]:
            sharded = total(recipe, other)
            if sharded <= limit:
                fits.append(f"sharded over {hw.gpus} GPUs it fits ({sharded / GIB:.1f} GiB: accelerate launch "
                            f"--config_file recipes/accelerate/deepspeed_{other}.yaml)")
                break
    head = f"{_setting(need, recipe)} needs {need.device_total / GIB:.1f} GiB > {hw.memory / GIB:.1f} GiB ({hw.name})"
    return f"{head}; " + ("; ".join(fits) if fits else f"no smaller {need.knob} fits: use a GPU with more memory")


def _smaller_budgets(budget: int, floor: int) -> list[int]:
    """budget/2, budget/4, ... down to `floor` (which ends the list)."""
    out, value = [], budget // 2
    while value > floor:
        out.append(value)
        value //= 2
    return out + ([floor] if floor < budget else [])


def _setting(need: Need, recipe: Recipe) -> str:
    section, name = need.knob.split(".")
    return f"{need.knob}={getattr(getattr(recipe, section), name)}"


def sharding_of(accelerator: Any) -> str:
    """ddp, zero2, zero3 or fsdp: how an accelerate run shards the optimizer state."""
    kind = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
    if kind == "DEEPSPEED":
        return "zero3" if int(getattr(accelerator.state.deepspeed_plugin, "zero_stage", 2)) == 3 else "zero2"
    return "fsdp" if kind == "FSDP" else "ddp"


def refuse_if_too_big(stage: str, recipe: Recipe, config: Any, memory: int, gpus: int, sharding: str = "ddp",
                      mixed: str | None = None) -> None:
    """EyasError naming the setting and what fits when the stage's need exceeds `memory` by more than
    REFUSE_MARGIN (the model's measured error); the stages call it before they load the target."""
    hw = Hardware("cuda", int(memory), int(gpus), "this GPU")
    advice = fit_advice(stage, recipe, config, hw, sharding, mixed, limit=memory * REFUSE_MARGIN)
    if advice:
        raise EyasError(f"this recipe will not fit: {advice} (the plan's model: `eyas plan RECIPE`, docs/stages.md)")


# ----------------------------------------------------------------------------- the command


def accelerate_sharding(path: str | None) -> str:
    """ddp, zero2, zero3 or fsdp from an accelerate config file (None: ddp)."""
    if not path:
        return "ddp"
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise EyasError(f"--accelerate-config '{path}' cannot be read ({exc})") from None
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        return "zero3" if int((config.get("deepspeed_config") or {}).get("zero_stage", 2)) == 3 else "zero2"
    return "fsdp" if kind == "FSDP" else "ddp"


def hardware(gpu: str | None, gpus: int, memory_gib: float | None) -> Hardware:
    if memory_gib is not None:
        return Hardware("cuda", int(memory_gib * GIB), gpus, gpu or f"{memory_gib:g} GiB")
    if gpu is None:
        return Hardware("cuda", None, gpus, "GPU")
    name = gpu.lower()
    if name not in GPUS:
        raise EyasError(f"unknown GPU '{gpu}'; known: {', '.join(GPUS)} (or give --gpu-memory GIB)")
    return Hardware("cuda", GPUS[name] * MIB, gpus, name)


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts.items() if value >= 0.05 * GIB)


def report(recipe: Recipe, config: Any, hw: Hardware, sharding: str, tokens: int | None) -> tuple[list[str], list[str]]:
    """The plan as printed lines, and one line per stage that does not fit (the setting and what fits)."""
    sizes = s, d = shapes_of(config), draft_size(recipe, config)
    needs = [stage_need(stage, recipe, config, s, d, hw, sharding) for stage in ("dump", "train", "eval")]
    lengths = prepared_lengths(recipe)
    gpu = f"{hw.gpus} x {hw.name}" + (f" ({hw.memory / GIB:.1f} GiB each)" if hw.memory else "")
    lines = [f"eyas plan: {recipe.run.name} on {gpu}",
             f"target: {getattr(config, 'model_type', '?')}, {s.params / 1e9:.2f}B parameters (hidden {s.hidden}, "
             f"{s.layers} layers, vocabulary {s.vocab}); {recipe.draft.kind} draft: {d.trainable / 1e6:.1f}M trainable + "
             f"{d.frozen / 1e6:.1f}M frozen parameters, draft vocabulary {d.draft_vocab}",
             "memory in GiB per GPU, and per host rank (the larger phase); parts under 0.05 GiB not listed"]
    for need in needs:
        fits = "" if hw.memory is None else ("  fits" if need.device_total <= hw.memory else "  DOES NOT FIT")
        lines.append(f"{need.stage:<6}{need.device_total / GIB:6.1f}{fits}: {_parts(need.device)}")
        if need.host:
            lines.append(f"{'':6}host {need.host_total / GIB:.1f} ({_parts(need.host)})")
        lines += [f"{'':6}{note}" for note in need.notes]
    per_token = shard_bytes(recipe, config)
    total = sum(per_token.values())
    lines.append(f"shards: {total:,} bytes per token (" + ", ".join(f"{k} {v:,}" for k, v in per_token.items()) + ")")
    counted = sum(int(v.sum()) for v in lengths.values()) if lengths else tokens
    if counted:
        lines.append(f"{'':8}{counted:,} tokens ({'prepared data' if lengths else '--tokens'}): "
                     f"{counted * total / GIB:,.1f} GiB on disk")
    steps, how = optimizer_steps(recipe, hw.gpus, lengths["train"] if lengths else None, tokens)
    lines.append(f"steps: {steps:,} optimizer steps ({how})" if steps else f"steps: {how}")
    problems = [a for a in (fit_advice(n.stage, recipe, config, hw, sharding, sizes=sizes) for n in needs) if a]
    return lines, problems


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eyas plan", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("recipe", help="recipe YAML file (see recipes/)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe keys, e.g. train.token_budget=16384")
    p.add_argument("--gpu", help=f"the GPU to plan for: {', '.join(GPUS)}")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (processes) per stage (default 1)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory per GPU in GiB, for a card not in the list")
    p.add_argument("--accelerate-config", metavar="FILE",
                   help="the accelerate config training is launched with (ZeRO-2/3, FSDP shard the optimizer); default DDP")
    p.add_argument("--target-config", metavar="PATH_OR_DIR",
                   help="the target's config.json (or its folder) when target.path has no model yet")
    p.add_argument("--tokens", type=int, help="training tokens, for the step count when nothing is prepared yet")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)

    def body() -> int:
        if args.gpus < 1:
            raise EyasError(f"--gpus must be at least 1, got {args.gpus}")
        hw = hardware(args.gpu, args.gpus, args.gpu_memory)
        recipe = load_recipe(args.recipe, list(args.overrides))
        config = read_config(recipe, args.target_config)
        lines, problems = report(recipe, config, hw, accelerate_sharding(args.accelerate_config), args.tokens)
        print("\n".join(lines))
        if problems:
            print("does not fit:\n" + "\n".join(f"  {line}" for line in problems))
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
