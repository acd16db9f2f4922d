"""The export contract a head kind fills in, and the Llama pieces every engine format is written from.

`eyas export` (`eyas.train.export`) is a driver over these: each kind's module declares one
`KindExport` (`DraftHead.export`) with a `FormatSpec` per engine format it can be served in. A
`FormatSpec` names every tensor the engine's draft model reads with its shape (from the head config
alone, written from the engine's module tree, so a renamed eyas tensor shows up as a mismatch), maps
eyas state_dict names to the engine's and back, writes the engine's config.json and says how to
serve it. The public source each format was checked against is recorded next to its mapping, in the
kind's module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eyas.draft.config import HeadConfig
from eyas.errors import EyasError

# The speculators config version the vLLM exports of speculators' formats (eagle3, peagle, dspark) declare.
SPECULATORS_VERSION = "0.3.0"
# Draft steps written into an export when neither the command line nor the checkpoint says how many.
DEFAULT_STEPS = 5

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ExportContext:
    """What a config.json writer needs beyond the head config."""

    dtype: str  # weights dtype name, written as torch_dtype
    speculative_tokens: int  # draft steps per verification
    target: dict  # path, architectures, max_position_embeddings, ... of the target when known (else empty)
    provenance: dict  # the `eyas` block every export carries (engines ignore it)


def llama_biases(cfg: HeadConfig, fmt: str) -> bool:
    """The Llama layer the engines build has biases on q/k/v and o_proj together, or none."""
    if cfg.qkv_bias != cfg.o_bias:
        raise EyasError(f"the draft has biases on q/k/v but not on o_proj (target family '{cfg.target_model_type}'); "
                        f"the Llama layer {fmt} builds for a {cfg.kind} draft has both or neither")
    return bool(cfg.qkv_bias)


def _same(name: str) -> str:
    return name


def _unchanged(state: State, cfg: HeadConfig) -> State:
    return state


def _no_step_check(cfg: HeadConfig, steps: int) -> None:
    return None


def _no_format_check(cfg: HeadConfig) -> None:
    return None


def _no_side_files(state: State, cfg: HeadConfig) -> dict:
    return {}


def _nothing_read(saved: dict, cfg: HeadConfig) -> State:
    return {}


def read_llama(config: dict) -> dict:
    """The kind-specific HeadConfig fields of a plain Llama-layout config.json (one layer, full vocabulary)."""
    return {"layer": config, "aux_layers": [], "num_layers": 1,
            "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"])}


@dataclass(frozen=True)
class FormatSpec:
    """How one engine's format holds one head kind."""

    architecture: str  # config.json `architectures[0]`, which selects the engine's draft model class
    method: str  # vLLM's --speculative-config `method`, or SGLang's --speculative-algorithm
    shapes: Callable[[HeadConfig, bool], dict[str, tuple]]  # (config, attention biases) -> every tensor read
    config: Callable[[HeadConfig, ExportContext], dict]  # the config.json the engine reads
    # (config, format) -> whether the layer carries attention biases; raises for a pattern it cannot hold
    biases: Callable[[HeadConfig, str], bool] = llama_biases
    to_engine: Callable[[str], str] = _same  # eyas state_dict name -> exported name
    to_eyas: Callable[[str], str] = _same  # exported name -> eyas state_dict name
    prepare: Callable[[State, HeadConfig], State] = _unchanged  # rewrites the state before mapping
    restore: Callable[[State, HeadConfig], State] = _unchanged  # undoes `prepare` when read back
    check_steps: Callable[[HeadConfig, int], None] = _no_step_check  # refusals that depend on the step count
    # files beside model.safetensors: (eyas state, config) -> {file name: object for torch.save}
    side_files: Callable[[State, HeadConfig], dict] = _no_side_files
    # ({file name: torch.load of it}, config) -> the eyas tensors they hold (`load_exported`)
    read_side_files: Callable[[dict, HeadConfig], State] = _nothing_read
    # refusals of this format from the head config alone (what its engine cannot serve exactly)
    check: Callable[[HeadConfig], None] = _no_format_check
    # more of the head's tensors that this format's engine takes from the target (beside the kind's own
    # `KindExport.from_target`): not written, and filled from the target when read back
    from_target: frozenset[str] = frozenset()
    serve_flags: str = ""  # extra flags of the serving command
    # SGLang's step flags ({steps}: drafted tokens; {tokens}: tokens per verify, steps + 1)
    sglang_steps: str = "--speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {tokens}"
    # extra fields of vLLM's --speculative-config (peagle: {"parallel_drafting": true})
    speculative_extra: dict = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other architectures the config writer may name (per target family)
    # the eyas plugin module its engine needs to serve it ("": the engine serves it as it ships)
    plugin: str = ""
    # the engine's draft model class that loads it, whose load record eyas reads for tensors left unloaded
    # ("": a loader eyas does not watch; vLLM's `AutoWeightsLoader` records a class by this name)
    engine_model: str = ""
    # why no engine served this format in eyas's tests ("": the serving tier serves it, tests/test_vllm_parity.py);
    # the export's marker records it in place of the engine version it was verified with
    engine_unchecked: str = ""
    # exported config.json -> {"layer": the dict of Llama fields, "aux_layers", "num_layers", "draft_vocab_size",
    # and any variant fields}: what the read-back head config takes from this format's layout
    read_config: Callable[[dict], dict] = read_llama


def _no_kind_check(cfg: HeadConfig, where: str) -> None:
    return None


def _default_steps(cfg: HeadConfig) -> int:
    return DEFAULT_STEPS


@dataclass(frozen=True)
class KindExport:
    """Everything `eyas export` needs to know about one head kind."""

    formats: dict[str, FormatSpec]
    # the head's frozen copies of target tensors, which the engines take from the target: not written
    from_target: frozenset[str]
    # refusals from the head config alone, before the weights are read; `where` names the checkpoint
    check: Callable[[HeadConfig, str], None] = _no_kind_check
    # draft steps when neither the command line nor the checkpoint's ttt_steps says
    default_steps: Callable[[HeadConfig], int] = _default_steps


# ----------------------------------------------------------------------------- Llama building blocks


def attention_shapes(cfg: HeadConfig, prefix: str, in_features: int, bias: bool) -> dict[str, tuple]:
    """q/k/v/o projections of a Llama attention reading `in_features`, under `prefix`."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    shapes = {f"{prefix}q_proj.weight": (q, in_features), f"{prefix}k_proj.weight": (kv, in_features),
              f"{prefix}v_proj.weight": (kv, in_features), f"{prefix}o_proj.weight": (cfg.hidden_size, q)}
    if bias:
        shapes.update({f"{prefix}q_proj.bias": (q,), f"{prefix}k_proj.bias": (kv,), f"{prefix}v_proj.bias": (kv,),
                       f"{prefix}o_proj.bias": (cfg.hidden_size,)})
    return shapes


def mlp_shapes(cfg: HeadConfig, prefix: str) -> dict[str, tuple]:
    """gate/up/down projections of a Llama MLP, under `prefix`."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {f"{prefix}gate_proj.weight": (i, h), f"{prefix}up_proj.weight": (i, h), f"{prefix}down_proj.weight": (h, i)}


def rope_fields(cfg: HeadConfig) -> dict:
    """`rope_theta` + `rope_scaling` (None for plain RoPE), the fields every engine reads."""
    params = dict(cfg.rope_parameters)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else dict(params, rope_type=rope_type)
    return {"rope_theta": theta, "rope_scaling": scaling}


def llama_fields(cfg: HeadConfig, num_layers: int, dtype: str) -> dict:
    """A Llama config.json's fields for the head's layer shapes (key order is the written order)."""
    bias = bool(cfg.qkv_bias and cfg.o_bias)
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        **rope_fields(cfg),
        "vocab_size": cfg.vocab_size,
        "attention_bias": bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def speculators_fields(algorithm: str, ctx: ExportContext) -> dict:
    """The fields every speculators-format config.json starts with (vLLM reads the method and the step count
    from `speculators_config`, and requires a verifier entry)."""
    return {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": ctx.speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": ctx.target.get("path"), "architectures": ctx.target.get("architectures", [])},
        },
    }


def llama_config(architecture: str, cfg: HeadConfig, ctx: ExportContext, num_layers: int = 1) -> dict:
    """The plain Llama config.json (architecture first, the layer's fields) most formats start from."""
    return {"architectures": [architecture], **llama_fields(cfg, num_layers, ctx.dtype)}
