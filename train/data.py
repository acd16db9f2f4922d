"""What the trainer reads: shards checked against the draft kind, a prefetching batch stream
that remembers the consumed data position, and the target's embedding / lm_head / norm.

Shards that do not fit the draft (an eagle3 head without the three fused layers, a hidden
size other than the target's, no teacher) are refused before any training step. Shards are
verified as `eyas.data.shards.ShardReader` describes: identity, sizes and every shard's header
(plan fingerprint) at open; offsets at a shard's first read; each sample's checksum at its first
read, in the prefetch thread, so a corrupt or foreign shard stops the run before the step that
would use it, with the file, what differs and the fix.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas.data.shards import MANIFEST, ShardReader
from eyas.errors import EyasError
from eyas.targets import load_target_config, resolve_target_path


def check_shards_fit(manifest: dict, kind: str, hidden_size: int, recipe_layers: list[int], where: Path) -> list[int]:
    """Raise EyasError if the shards cannot train this draft kind; return the fused layers."""
    features = manifest.get("features", {})
    dumped_hidden = int(manifest.get("hidden_size", -1))
    if dumped_hidden != hidden_size:
        raise EyasError(f"the shards in '{where}' hold hidden size {dumped_hidden}, the target has {hidden_size}; "
                        "dump again for this target (`eyas dump RECIPE`)")
    layers = list(manifest.get("layers") or [])
    if kind == "eagle3":
        aux = features.get("aux_hidden")
        if aux is None or len(aux.get("layers", [])) != 3:
            raise EyasError(f"draft.kind eagle3 needs the three fused layers (aux_hidden), but the shards in '{where}' "
                            f"were dumped for draft.kind={manifest.get('draft_kind')!r} without them; "
                            "dump again with draft.kind=eagle3")
        if int(aux["shape"][0]) != 3 * hidden_size:
            raise EyasError(f"the fused layers in '{where}' are {aux['shape'][0]} wide, expected 3 x {hidden_size}")
        if recipe_layers and list(recipe_layers) != layers:
            raise EyasError(f"recipe dump.layers is {list(recipe_layers)} but the shards in '{where}' hold layers "
                            f"{layers}; dump again or set dump.layers={layers}")
    elif "last_hidden" not in features:
        raise EyasError(f"draft.kind {kind} reads the target's last hidden state, which the shards in '{where}' do not "
                        "hold; dump again with this draft kind")
    if "last_hidden" not in features and "topk_values" not in features:
        raise EyasError(f"the shards in '{where}' hold no teacher (neither last_hidden nor topk); dump again")
    return layers


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


class BatchStream:
    """Endless batches over epochs from a TokenBudgetLoader, read ahead by a thread.

    Yields (batch, position): `position` is the loader state *after* this batch, so a
    checkpoint taken after consuming it resumes at the next one, whatever the thread has
    already read ahead. An epoch that yields no batch for this rank is an error (it would
    loop forever).
    """

    def __init__(self, loader: Any, prefetch: int = 2) -> None:
        self.loader = loader
        self.prefetch = int(prefetch)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._iter: Iterator | None = None

    def _produce(self) -> Iterator[tuple[dict, dict]]:
        empty_epochs = 0  # one empty pass is normal (resuming at the end of an epoch), two are not
        while True:
            produced = 0
            for batch in self.loader:
                produced += 1
                yield batch, self.loader.state_dict()
            empty_epochs = 0 if produced else empty_epochs + 1
            if empty_epochs >= 2:
                raise EyasError("the training data yields no batch for this process (fewer batches than processes?); "
                                "use more data, a smaller train.token_budget or fewer processes")

    def _worker(self) -> None:
        try:
            for item in self._produce():
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put(exc)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[dict, dict]:
        if self.prefetch <= 0:
            if self._iter is None:
                self._iter = self._produce()
            return next(self._iter)
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._worker, name="eyas-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


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
