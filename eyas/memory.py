"""What every stage's memory model shares: the hardware, the target's sizes, the draft's, and a stage's need.

Each stage models its own memory beside its code (`eyas.data.memory` the dump, `eyas.train.memory`
the trainer, `eyas.eval.memory` eval); `eyas plan` composes them. Those models read the target's
shapes, the bytes of its weights and the working set of one of its layers the same way, and a fit
search that lowers a token budget is the same search in every stage: those live here, once. This
module imports no stage (`tests/test_architecture.py`).

Everything comes from the recipe and the target's `config.json` alone: parameters are counted on
accelerate's empty-weights device, so no weights are loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eyas.draft.config import target_shapes, text_config
from eyas.recipe_schema import Recipe

GIB = float(1 << 30)
MIB = 1 << 20
# Memory a CUDA process holds outside torch's tensors: the CUDA context, cuBLAS workspaces and NCCL
# buffers (about 0.5-1 GiB per process on A100/H100: nvidia-smi's figure minus
# torch.cuda.memory_reserved). An assumption: eyas has not run on a GPU yet.
CUDA_RUNTIME = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """Where a stage runs: `device` cuda or cpu, memory per device (None: unknown), processes."""

    device: str = "cuda"
    memory: int | None = None
    gpus: int = 1
    name: str = "GPU"


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
    """The draft head's parameters and the layout of one draft step, from a head built without weights
    (`eyas.train.memory.draft_size`; eval reads its parameter count too)."""

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


def target_bytes(recipe: Recipe, hw: Hardware) -> int:
    """Bytes per target weight: target.dtype (auto: bf16 on a GPU, fp32 on a CPU)."""
    dtype = recipe.target.dtype
    if dtype == "auto":
        return 2 if hw.device == "cuda" else 4
    return 4 if dtype == "float32" else 2


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


# ----------------------------------------------------------------------------- what would fit


def with_setting(recipe: Recipe, key: str, value: Any) -> Recipe:
    """A copy of the recipe with `section.key` set (no validation: the fit search only lowers a budget)."""
    section, name = key.split(".")
    return dataclasses.replace(recipe, **{section: dataclasses.replace(getattr(recipe, section), **{name: value})})


def smaller_budget_that_fits(recipe: Recipe, stage: str, total: Callable[[Recipe], float],
                             limit: float) -> tuple[int, float] | None:
    """(budget, its need) for the first of `<stage>.token_budget` halved, down to data.max_length, whose
    `total(recipe)` fits in `limit` bytes; None if none does. A sample longer than a budget is a batch of
    its own, so no budget below data.max_length is tried."""
    budget = getattr(recipe, stage).token_budget
    for value in _smaller_budgets(budget, recipe.data.max_length):
        need = total(with_setting(recipe, f"{stage}.token_budget", value))
        if need <= limit:
            return value, need
    return None


def _smaller_budgets(budget: int, floor: int) -> list[int]:
    """budget/2, budget/4, ... down to `floor` (which ends the list)."""
    out, value = [], budget // 2
    while value > floor:
        out.append(value)
        value //= 2
    return out + ([floor] if floor < budget else [])


def advice(need: Need, recipe: Recipe, hw: Hardware, limit: float | None, fits: Callable[[], list[str]]) -> str | None:
    """None if `need` fits in `limit` bytes per device (or no limit is known), else one line: the setting, its
    need against the GPU's memory, and what would fit (`fits()`, the stage's own search)."""
    if limit is None or need.device_total <= limit:
        return None
    found = fits()
    head = f"{_setting(need, recipe)} needs {need.device_total / GIB:.1f} GiB > {hw.memory / GIB:.1f} GiB ({hw.name})"
    return f"{head}; " + ("; ".join(found) if found else f"no smaller {need.knob} fits: use a GPU with more memory")


def _setting(need: Need, recipe: Recipe) -> str:
    section, name = need.knob.split(".")
    return f"{need.knob}={getattr(getattr(recipe, section), name)}"
