"""What the trainer reads: shards checked against the draft kind, and the target's embedding /
lm_head / norm (the batches themselves come from `eyas.train.loader`).

Shards that do not fit the draft (an eagle3 head without the three fused layers, a hidden
size other than the target's, no teacher) are refused before any training step. Shards are
verified as `eyas.data.shard_reader.ShardReader` describes: identity, sizes and every shard's header
(plan fingerprint) at open; offsets at a shard's first read; each sample's checksum at its first
read, in the loader's workers, so a corrupt or foreign shard stops the run before the step that
would use it, with the file, what differs and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas.data.shard_format import MANIFEST
from eyas.data.shard_reader import ShardReader
from eyas.draft.features import LAST_HIDDEN
from eyas.draft.registry import head_class
from eyas.errors import EyasError
from eyas.targets import load_target_config, resolve_target_path


def check_shards_fit(manifest: dict, kind: str, hidden_size: int, recipe_layers: list[int], where: Path) -> list[int]:
    """Raise EyasError if the shards cannot train this draft kind; return the fused layers.

    What the kind reads is its feature spec (`eyas.draft.features`), checked against the manifest's
    `features`; the teacher (the last hidden state or a stored top-k) is every kind's.
    """
    features = manifest.get("features", {})
    dumped_hidden = int(manifest.get("hidden_size", -1))
    if dumped_hidden != hidden_size:
        raise EyasError(f"the shards in '{where}' hold hidden size {dumped_hidden}, the target has {hidden_size}; "
                        "dump again for this target (`eyas dump RECIPE`)")
    head_class(kind).feature_spec.check(manifest, kind, hidden_size, recipe_layers, where)
    if LAST_HIDDEN.name not in features and "topk_values" not in features:
        raise EyasError(f"the shards in '{where}' hold no teacher (neither last_hidden nor topk); dump again")
    return list(manifest.get("layers") or [])


def open_shards(run_dir: Path, kind: str, hidden_size: int, recipe_layers: list[int], identity: str) -> dict:
    """Train and held-out readers (held-out None when not dumped) and the fused layers."""
    root = Path(run_dir) / "shards"
    reader = ShardReader(root, expect_identity=identity)
    layers = check_shards_fit(reader.manifest, kind, hidden_size, recipe_layers, root)
    heldout = None
    if (root / "heldout" / MANIFEST).is_file():
        heldout = ShardReader(root / "heldout", expect_identity=identity)
        check_shards_fit(heldout.manifest, kind, hidden_size, recipe_layers, root / "heldout")
    return {"train": reader, "heldout": heldout, "layers": layers, "root": root}


def read_target_weights(target_path: str, trust_remote_code: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding [V,H], lm_head [V,H], final norm [H]) read straight from the target's safetensors.

    Llama/Qwen-style names are tried first; other layouts ask the model class itself (built on
    the meta device); without safetensors files the whole target is loaded instead.
    """
    config = load_target_config(target_path, trust_remote_code=trust_remote_code)
    files = _safetensors_map(target_path)
    if files is None:
        return _weights_from_full_model(target_path, trust_remote_code)

    embed_name, head_name, norm_name = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
    if embed_name not in files or norm_name not in files:  # not the Llama/Qwen layout: ask the model class
        embed_name, head_name, norm_name = _parameter_names(config, trust_remote_code)

    def read(name: str | None) -> torch.Tensor | None:
        return None if name is None else _read_tensor(target_path, files, name)

    embed = read(embed_name)
    head = read(head_name)
    if head is None and getattr(config, "tie_word_embeddings", False):
        head = embed
    if embed is None or head is None:
        return _weights_from_full_model(target_path, trust_remote_code)
    return embed, head, read(norm_name)


def _safetensors_map(target_path: str) -> dict[str, str] | None:
    """Tensor name -> safetensors file of the target's folder (None: it has no safetensors files)."""
    folder = Path(resolve_target_path(target_path))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    return None


def _read_tensor(target_path: str, files: dict[str, str], name: str) -> torch.Tensor | None:
    if name not in files:
        return None
    with safe_open(str(Path(resolve_target_path(target_path)) / files[name]), "pt") as f:
        return f.get_tensor(name).float()


def read_target_layer(target_path: str, trust_remote_code: bool = False, target_model: Any = None
                      ) -> tuple[int, dict[str, torch.Tensor]]:
    """(index, tensors) of the target's last decoder layer, named as inside the layer (`self_attn.o_proj.weight`).

    Read from a loaded `target_model` when given, else straight from the safetensors files
    (Llama/Qwen names `model.layers.{i}.`); a target of another layout is refused with the fix.
    """
    config = getattr(target_model, "config", None) or load_target_config(target_path, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    last = int(config.num_hidden_layers) - 1
    prefix = f"model.layers.{last}."
    if target_model is not None:  # only the last layer's tensors are copied to fp32, not the whole model
        tensors = {name[len(prefix):]: t.detach().float() for name, t in target_model.state_dict().items()
                   if name.startswith(prefix)}
    else:
        files = _safetensors_map(target_path) or {}
        tensors = {name[len(prefix):]: _read_tensor(target_path, files, name) for name in files if name.startswith(prefix)}
    if not tensors:
        raise EyasError(f"train.draft_init=target_last_layer: no '{prefix}*' weights in the target '{target_path}' "
                        "(not a Llama/Qwen-style layout, or no safetensors files); use train.draft_init=random")
    return last, tensors


def _parameter_names(config: Any, trust_remote_code: bool = False) -> tuple[str, str, str | None]:
    """Embedding, lm_head and final-norm weight names of the target's class (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = {id(m): n for n, m in skeleton.named_modules()}
    base = getattr(skeleton, "model", skeleton)
    return (names[id(skeleton.get_input_embeddings())] + ".weight",
            names[id(skeleton.get_output_embeddings())] + ".weight",
            names[id(base.norm)] + ".weight" if hasattr(base, "norm") else None)


def _weights_from_full_model(target_path: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_target_path(target_path), dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    base = getattr(model, "model", model)
    norm = base.norm.weight.detach() if hasattr(base, "norm") else None
    return (model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach(), norm)
