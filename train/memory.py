"""The trainer's memory model: the draft's size, what one training step keeps, and the optimizer steps.

Counted tensor by tensor from the trainer's own code (which tensors autograd keeps in the unroll, which
copies a cast makes, what AdamW and each sharding hold), so it lives beside it; `eyas plan` composes it
with the dump's and eval's, and the types it shares with them are `eyas.memory`'s. Checked against
measured peak memory by `benchmarks/bench_plan.py` and against what autograd keeps by
`tests/test_plan.py`.

`refuse_if_too_big` is this model as a check: training on CUDA refuses a recipe whose need exceeds the
GPU by more than the model's measured error, before it loads the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eyas.data.dump import feature_spec, manifest_features
from eyas.data.memory import shard_bytes
from eyas.draft.config import target_shapes, text_config
from eyas.draft.features import FUSED_LAYERS, LAST_HIDDEN
from eyas.draft.head import DraftHead
from eyas.draft.registry import build_head, head_class, uses_draft_vocab
from eyas.draft.ttt_attention import dense_fallback_reason
from eyas.errors import EyasError
from eyas.memory import (
    CUDA_RUNTIME,
    GIB,
    DraftSize,
    Hardware,
    Need,
    Shapes,
    advice,
    forward_bytes,
    shapes_of,
    smaller_budget_that_fits,
    target_bytes,
    with_setting,
)
from eyas.precision import mixed_precision_for
from eyas.recipe_schema import Recipe
from eyas.train.loader import TokenBudgetLoader

# A recipe is refused only when its need exceeds the GPU by more than the model's measured error
# (benchmarks/bench_plan.py: |measured/predicted - 1| <= 0.15), so a recipe at the edge is tried.
REFUSE_MARGIN = 1.15
# Sharding that holds less per GPU than the one in use, in the order to try.
LESS_PER_GPU = {"ddp": ("zero2", "zero3"), "zero2": ("zero3",), "zero3": (), "fsdp": ()}


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


# ----------------------------------------------------------------------------- the draft


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
    blocks = head.decoder_layers()
    block = blocks[0]
    shared = _weights_every_step_uses(head, trainable, blocks)
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
        projection_in=head.projection.in_features if head.projection is not None else 0,
        frozen_matmul=sum(m.weight.numel() for m in head.modules()
                          if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad))


def _weights_every_step_uses(head: DraftHead, trainable: list[torch.nn.Parameter],
                             blocks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The trainable weights every unrolled step uses, whose gradients accumulate over the steps: a shared
    layer's, and the lm_head and final norm outside the layers (not the once-per-unroll projection)."""
    in_blocks = {id(p) for layer in blocks for p in layer.parameters()}
    projection = {id(p) for p in head.projection.parameters()} if head.projection is not None else set()
    # the layout the kind declares says whether each step has layers of its own (mtp: counted once, not per step)
    return [p for p in trainable if id(p) not in projection and (not head.layout.weights_per_step or id(p) not in in_blocks)]


def _step_norms(head: DraftHead, blocks: list[torch.nn.Module]) -> int:
    """RMSNorms of one draft step: those of its layer, and a final norm outside the layers (eagle3's `norm`)."""
    inside = {id(m) for layer in blocks for m in layer.modules()}
    norms = sum(1 for m in blocks[0].modules() if isinstance(m, LlamaRMSNorm))
    return norms + (1 if any(id(m) not in inside for m in head.final_norms()) else 0)


def _unroll_steps(recipe: Recipe) -> int:
    """The draft steps one training forward unrolls: train.ttt_steps; EAGLE-1 trains one (plus its feature
    regression)."""
    return head_class(recipe.draft.kind).unroll_steps(recipe.train.ttt_steps)


# ----------------------------------------------------------------------------- one training step


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


# ----------------------------------------------------------------------------- the stage


def train_need(recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware, sharding: str = "ddp",
               mixed: str | None = None, dense: bool | None = None) -> Need:
    """Training on one device, steady state (the optimizer state exists), N = max(train.token_budget, data.max_length).

    device = `optimizer_need`
           + teacher lm_head: the target's, all V rows (the draft rows and the rest, for the held-out argmax),
             V·H x (2 under bf16 on a GPU, else 4)
           + batch: N x (4 x the dumped feature widths, decoded on the device + 8 ids + 4 loss mask + 8
             attention mask; a top-k teacher 12·k)
           + teacher distribution: N x (4·V' probabilities + 4 sum p log p + 8 argmax)
           + activations: `unroll_bytes` (K = `_unroll_steps`) + `projection_bytes`
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
    `dense`: the unroll's attention runs densely ([T, T] scores); None: where it does for want of a half
    precision (fp32 on a GPU). The trainer passes True where CUDA's flash kernel refuses its shapes.
    """
    p = precision_of(recipe, hw, sharding, mixed)
    cfg = recipe.train
    n = max(cfg.token_budget, recipe.data.max_length)
    steps = _unroll_steps(recipe)
    spec = feature_spec(recipe, config)
    features = manifest_features(spec, s.hidden)
    widths = sum(int(f["shape"][0]) for name, f in features.items() if name in (FUSED_LAYERS.name, LAST_HIDDEN.name))
    batch = n * (4 * widths + spec["topk"] * (4 + 8) + 8 + 4 + 8)
    project = projection_bytes(s, d, p, n, int(features[head_class(recipe.draft.kind).feature]["shape"][0]))
    dense = (hw.device == "cuda" and p.activation == 4 if dense is None else dense) and steps > 1
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
             + (", dense [T, T] attention" + (" (fp32 on a GPU)" if p.activation == 4 else "") if dense else "")]
    return Need("train", device, host, "train.token_budget", notes)


def train_fits(recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware, sharding: str, mixed: str | None,
               limit: float, dense: bool | None = None) -> list[str]:
    """What would make training fit in `limit` bytes per GPU, one line each, each at the recipe's own budget
    but the first: a smaller train.token_budget (with grad_accum raised to keep the tokens per step),
    recomputing the unroll (train.checkpoint_unroll), and sharding the optimizer state over several GPUs;
    where the attention runs densely, bf16 (where fp32 is why) or a shorter data.max_length."""

    def total(changed: Recipe, how: str = sharding, precision: str | None = mixed) -> float:
        return train_need(changed, config, s, d, hw, how, precision, dense).device_total

    fits = []
    smaller = smaller_budget_that_fits(recipe, "train", total, limit)
    if smaller:
        value, need = smaller
        budget = recipe.train.token_budget
        accum = f", with train.grad_accum={recipe.train.grad_accum * budget // value} for the same tokens per step" \
            if budget % value == 0 else ""
        fits.append(f"train.token_budget={value} fits ({need / GIB:.1f} GiB{accum})")
    if not recipe.train.checkpoint_unroll:
        recomputed = total(with_setting(recipe, "train.checkpoint_unroll", True))
        if recomputed <= limit:
            fits.append(f"train.checkpoint_unroll=true fits ({recomputed / GIB:.1f} GiB, one more forward per step)")
    if hw.gpus > 1:
        for other in LESS_PER_GPU[sharding]:
            sharded = total(recipe, other)
            if sharded <= limit:
                fits.append(f"sharded over {hw.gpus} GPUs it fits ({sharded / GIB:.1f} GiB: accelerate launch "
                            f"--config_file recipes/accelerate/deepspeed_{other}.yaml)")
                break
    fp32 = precision_of(recipe, hw, sharding, mixed).activation == 4
    return fits + _dense_fits(recipe, hw, total, limit, dense, fp32) if _unroll_steps(recipe) > 1 else fits


def _dense_fits(recipe: Recipe, hw: Hardware, total: Callable[..., float], limit: float, dense: bool | None,
                fp32: bool) -> list[str]:
    """Where the dense attention's [T, T] scores are the trouble: bf16, whose fused kernel has none (where fp32
    is the only reason for the dense path), else the longest data.max_length (halved) that fits."""
    if hw.device != "cuda" or not (dense or (dense is None and fp32)):
        return []
    if dense is None:
        half = total(with_setting(recipe, "train.mixed_precision", "bf16"), precision="bf16")
        if half <= limit:
            return [f"train.mixed_precision=bf16 fits ({half / GIB:.1f} GiB: CUDA's flash kernel runs it, "
                    "no [T, T] scores)"]
    length = recipe.data.max_length // 2
    while length >= 256:
        need = total(with_setting(recipe, "data.max_length", length))
        if need <= limit:
            return [f"data.max_length={length} fits ({need / GIB:.1f} GiB; the dense attention's scores grow "
                    "with the square of the length)"]
        length //= 2
    return []


def sharding_name(distributed_type: str, zero_stage: int = 2) -> str:
    """ddp, zero2, zero3 or fsdp from accelerate's distributed type (DEEPSPEED, FSDP, ...) and ZeRO stage."""
    kind = distributed_type.upper()
    if kind == "DEEPSPEED":
        return "zero3" if zero_stage == 3 else "zero2"
    return "fsdp" if kind == "FSDP" else "ddp"


def sharding_of(accelerator: Any) -> str:
    """ddp, zero2, zero3 or fsdp: how an accelerate run shards the optimizer state."""
    kind = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
    stage = int(getattr(accelerator.state.deepspeed_plugin, "zero_stage", 2)) if kind == "DEEPSPEED" else 2
    return sharding_name(kind, stage)


def refuse_if_too_big(stage: str, recipe: Recipe, config: Any, memory: int, gpus: int, sharding: str = "ddp",
                      mixed: str | None = None, dense_reason: str = "") -> None:
    """EyasError naming the setting and what fits when training's need exceeds `memory` by more than
    REFUSE_MARGIN (the model's measured error); the trainer calls it before it loads the target. `stage`:
    "train", the one stage whose check this is (its model lives here). `dense_reason`: why the unroll's
    attention would run densely on this GPU (`eyas.draft.ttt_attention.dense_fallback_reason`), "" if fused."""
    if stage != "train":
        raise ValueError(f"refuse_if_too_big checks training, not '{stage}'")
    hw = Hardware("cuda", int(memory), int(gpus), "this GPU")
    s, d = shapes_of(config), draft_size(recipe, config)
    limit = memory * REFUSE_MARGIN
    dense = True if dense_reason else None
    found = advice(train_need(recipe, config, s, d, hw, sharding, mixed, dense), recipe, hw, limit,
                   lambda: train_fits(recipe, config, s, d, hw, sharding, mixed, limit, dense))
    if found:
        why = f"; the unroll's attention runs densely here ({dense_reason})" if dense_reason else ""
        raise EyasError(f"this recipe will not fit: {found}{why} (the plan's model: `eyas plan RECIPE`, "
                        "docs/stages.md)")


# ----------------------------------------------------------------------------- optimizer steps


class _Lengths:
    """What TokenBudgetLoader reads to plan its batches: the sample lengths."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)


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


def dense_attention_reason(train_steps: int, accelerator: Any, target_config: Any) -> str:
    """Why the unroll's attention would run densely on this GPU ("" where it runs fused, or has one step)."""
    if train_steps < 2:
        return ""
    s = target_shapes(target_config)  # the attention layout alone (shapes_of also counts the target's parameters)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    return dense_fallback_reason(accelerator.device, dtype, s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"])
