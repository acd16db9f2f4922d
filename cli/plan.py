"""`eyas plan RECIPE`: GPU memory, host memory, shard bytes and optimizer steps of each stage, before anything runs.

Everything comes from the recipe and the target's `config.json` alone: no weights are loaded
(parameters are counted on accelerate's empty-weights device), so the plan of an 8B recipe runs
on a laptop with the 8B config downloaded alone (`--target-config`). Per stage it prints the
memory per GPU, split into named parts (weights, optimizer state, activations, KV cache, ...),
the memory per host rank, the dump's bytes per token on disk, the optimizer steps, and for the
GPU named (`--gpu h100-80gb --gpus 8`) what does not fit and what would ("train.token_budget=65536
needs 206.0 GiB > 79.6 GiB (h100-80gb); train.token_budget=16384 fits (62.2 GiB, ...)").

Each stage models its own memory beside its code, each part a named function with its formula:
the dump in `eyas.data.memory`, the trainer (and its optimizer steps) in `eyas.train.memory`, eval in
`eyas.eval.memory`, on the types they share in `eyas.memory`. This module only composes them: it
reads the target's config, calls each stage's model and its search for what would fit, and prints the
report. The parts were counted tensor by tensor from the code they describe and the whole was checked
against measured peak memory by `benchmarks/bench_plan.py` (docs/results.md, "Plan"). Not modelled:
the caching allocator's fragmentation on a GPU and the Python process itself (about 1 GiB of host
memory per rank before anything loads).

This is front-door code: it imports every stage's memory model, which no stage imports back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from eyas.config import load_recipe
from eyas.data.dump import sample_lengths
from eyas.data.memory import dump_fits, dump_need, shard_bytes
from eyas.data.prepare import load_prepared
from eyas.errors import EyasError, UnsupportedTarget
from eyas.eval.memory import eval_need
from eyas.memory import GIB, MIB, DraftSize, Hardware, Need, Shapes, advice, shapes_of
from eyas.recipe_schema import Recipe
from eyas.stage_cli import guarded
from eyas.targets import check_layer_kinds, load_target_config
from eyas.train.memory import draft_size, optimizer_steps, sharding_name, train_fits, train_need
from eyas.train.stream import plan_lines as stream_plan_lines

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


def prepared_lengths(recipe: Recipe) -> dict[str, np.ndarray] | None:
    """Sample lengths of the prepared splits, or None when `runs/<name>/prepared` does not exist yet."""
    if not (recipe.run_dir / "prepared" / "train" / "dataset_info.json").is_file():
        return None
    out = {"train": sample_lengths(load_prepared(recipe.run_dir, "train"))}
    if (recipe.run_dir / "prepared" / "heldout" / "dataset_info.json").is_file():
        out["heldout"] = sample_lengths(load_prepared(recipe.run_dir, "heldout"))
    return out


# ----------------------------------------------------------------------------- composing the stages' models


def stage_need(stage: str, recipe: Recipe, config: Any, s: Shapes, d: DraftSize, hw: Hardware,
               sharding: str = "ddp", mixed: str | None = None) -> Need:
    """One stage's need, from that stage's own model."""
    if stage == "dump":
        return dump_need(recipe, config, s, hw)
    if stage == "train":
        return train_need(recipe, config, s, d, hw, sharding, mixed)
    return eval_need(recipe, config, s, d, hw)


def fit_advice(stage: str, recipe: Recipe, config: Any, hw: Hardware, sharding: str = "ddp", mixed: str | None = None,
               limit: float | None = None, sizes: tuple[Shapes, DraftSize] | None = None) -> str | None:
    """None if the stage fits in `limit` bytes (default: the GPU's memory), else one line: the setting, its
    need, and what would fit, from the stage's own search (`dump_fits`, `train_fits`; eval offers none)."""
    limit = hw.memory if limit is None else limit
    s, d = sizes or (shapes_of(config), draft_size(recipe, config))

    def fits() -> list[str]:
        if stage == "dump":
            return dump_fits(recipe, config, s, hw, limit)
        return train_fits(recipe, config, s, d, hw, sharding, mixed, limit) if stage == "train" else []

    return advice(stage_need(stage, recipe, config, s, d, hw, sharding, mixed), recipe, hw, limit, fits)


# ----------------------------------------------------------------------------- the command


# How the plan names each sharding of the optimizer state and gradients (`--accelerate-config`).
SHARDING_NAMES = {"ddp": "DDP (each GPU holds all the optimizer state; give --accelerate-config for ZeRO or FSDP)",
                  "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3", "fsdp": "FSDP"}


def accelerate_sharding(path: str | None) -> str:
    """ddp, zero2, zero3 or fsdp from an accelerate config file (None: ddp)."""
    if not path:
        return "ddp"
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise EyasError(f"--accelerate-config '{path}' cannot be read ({exc})") from None
    return sharding_name(str(config.get("distributed_type", "NO")),
                         int((config.get("deepspeed_config") or {}).get("zero_stage", 2)))


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


def report(recipe: Recipe, config: Any, hw: Hardware, sharding: str, tokens: int | None,
           rates: tuple[float | None, float | None] = (None, None)) -> tuple[list[str], list[str]]:
    """The plan as printed lines, and one line per stage that does not fit (the setting and what fits). `rates`:
    a streamed run's measured engine and trainer tokens/s."""
    sizes = s, d = shapes_of(config), draft_size(recipe, config)
    needs = [stage_need(stage, recipe, config, s, d, hw, sharding) for stage in ("dump", "train", "eval")]
    lengths = prepared_lengths(recipe)
    gpu = f"{hw.gpus} x {hw.name}" + (f" ({hw.memory / GIB:.1f} GiB each)" if hw.memory else "")
    lines = [f"eyas plan: {recipe.run.name} on {gpu}",
             f"target: {getattr(config, 'model_type', '?')}, {s.params / 1e9:.2f}B parameters (hidden {s.hidden}, "
             f"{s.layers} layers, vocabulary {s.vocab}); {recipe.draft.kind} draft: {d.trainable / 1e6:.1f}M trainable + "
             f"{d.frozen / 1e6:.1f}M frozen parameters, draft vocabulary {d.draft_vocab}",
             f"training planned with {SHARDING_NAMES[sharding]}",
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
    if recipe.train.source == "stream":
        lines += stream_plan_lines(recipe, config, s, d, hw.gpus, lengths, *rates)
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
    p.add_argument("--engine-tokens-per-s", type=float, metavar="N",
                   help="train.source=stream: a capture engine's measured tokens/s (benchmarks/bench_stream.py)")
    p.add_argument("--trainer-tokens-per-s", type=float, metavar="N",
                   help="train.source=stream: a trainer's measured tokens/s from shards, to size the engines against")
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
        lines, problems = report(recipe, config, hw, accelerate_sharding(args.accelerate_config), args.tokens,
                                 (args.engine_tokens_per_s, args.trainer_tokens_per_s))
        print("\n".join(lines))
        if problems:
            print("does not fit:\n" + "\n".join(f"  {line}" for line in problems))
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
