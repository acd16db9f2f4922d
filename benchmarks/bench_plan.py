"""Plan benchmark: the memory `eyas plan` predicts against the peak memory measured, dump and train.

Run: `flock /tmp/eyas-heavy.lock python benchmarks/bench_plan.py` (about 6 minutes and 14 GB of memory
on 2 CPU cores; `--layers`, `--seq`, `--ttt-steps` to change the shapes; `--smoke`: a tiny target, about
a minute (three fresh processes), whose figures test the plumbing only). One pass: peak memory does not
move with the machine's load as timings do (two runs agreed within 0.7%).

The target is Llama-3.1-8B's shape at full width (hidden 4096, intermediate 14336, 32 heads, 8 kv
heads, vocabulary 128256, RoPE llama3) with only `--layers` decoder layers, built in code with random
weights and saved with `save_pretrained` (tests/fixtures.py's tokenizer). On it, in fp32 on the CPU
with no optimizer sharding:

1. dump: `eyas dump` of whole batches of `dump.token_budget` tokens (`--seq`-token samples);
2. train: two optimizer steps of the full-size EAGLE-3 head (424.7M trainable parameters, draft
   vocabulary 32000) on those shards, `--seq` tokens per micro-batch, unrolled `--ttt-steps` deep
   (AdamW's state exists from the first step on, so the second step is the steady state `eyas plan`
   describes), and the same with one unrolled step, whose difference isolates the unroll's activations.

Each runs in a fresh subprocess. Measured: its peak resident memory (VmHWM, reset once the target or
the trainer is built, so the peak is the stage's, not the loading's) minus its resident memory after
imports. Predicted: `eyas plan`'s device total plus host total for the same recipe (`Hardware("cpu")`), from
the dump's and the trainer's own models (`eyas.data.memory`, `eyas.train.memory`).
Figures: |measured / predicted - 1| per stage, and for the unroll the same on the difference between
the deep and the one-step run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import machine  # benchmarks/machine.py

RESULTS = machine.REPO / "benchmarks" / "results" / "bench_plan.json"
# meta-llama/Llama-3.1-8B-Instruct's config.json (the fields transformers reads), as published.
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
WORDS = ("the hawk flies over mountains rivers and the quiet valley while speculative drafts guess tokens that "
         "a large target verifies in one pass music books walks parks summary capital France Paris story").split()


# ----------------------------------------------------------------------------- the run


def build_target(folder: Path, layers: int) -> Path:
    """Llama-3.1-8B's shape with `layers` decoder layers, random bf16 weights, the tests' tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = machine.tests_module("fixtures").build_tokenizer()  # a byte-level BPE with a ChatML template
    fields = {k: v for k, v in LLAMA31_8B_CONFIG.items() if k not in ("architectures", "torch_dtype")}
    config = LlamaConfig(**{**fields, "num_hidden_layers": layers, "bos_token_id": tokenizer.bos_token_id,
                            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_chats(path: Path, count: int, words: int) -> None:
    """`count` ShareGPT conversations whose reply is `words` random words (longer than the samples)."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            reply = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Tell me story {i}."},
                                                  {"from": "gpt", "value": reply}]}) + "\n")


def overrides(root: Path, target: Path, args: argparse.Namespace, ttt_steps: int) -> list[str]:
    """The recipe measured: fp32 on the CPU, samples of `seq` tokens, one dump batch of `dump_batch` samples."""
    return [f"run.output_dir={root}", "run.name=plan", f"target.path={target}", "target.dtype=float32",
            f"data.source={root / 'chats.jsonl'}", f"data.max_length={args.seq}", "data.heldout_fraction=0.1",
            f"dump.token_budget={args.seq * args.dump_batch}", f"dump.shard_tokens={args.seq * 4 * args.dump_batch}",
            f"dump.draft_vocab_size={args.draft_vocab}", "draft.kind=eagle3", f"train.token_budget={args.seq}",
            f"train.ttt_steps={ttt_steps}", "train.mixed_precision=fp32", "train.max_steps=2", "train.warmup_steps=0",
            "train.eval_every=0", "train.save_every=0", "train.loader_workers=0", "train.logger=none"]


def child(stage: str, recipe_overrides: list[str]) -> dict:
    """In a fresh process: resident memory after imports, after building, and the stage's peak (KiB)."""
    import torch  # noqa: F401 - imported before the baseline, as everything the stage needs

    from eyas.config import load_recipe
    from eyas.data.dump import dump
    from eyas.targets import load_target
    from eyas.train.loader import BatchStream
    from eyas.train.loop import Trainer

    recipe = load_recipe(None, recipe_overrides)
    base = machine.status_kib("VmRSS")
    started = time.perf_counter()
    if stage == "dump":
        model, tokenizer = load_target(recipe.target)
        built = machine.status_kib("VmRSS")
        machine.reset_peak()
        dump(recipe, model, tokenizer)
    else:
        trainer = Trainer(recipe)
        built = machine.status_kib("VmRSS")
        machine.reset_peak()
        stream = BatchStream(trainer.setup.loader, recipe.train.prefetch, recipe.train.loader_workers)
        try:
            for _ in range(recipe.train.max_steps):  # the second step runs with AdamW's state
                trainer.train_step([next(stream) for _ in range(recipe.train.grad_accum)])
                trainer.state.step += 1
        finally:
            stream.close()
    return {"base_kib": base, "built_kib": built, "peak_kib": machine.status_kib("VmHWM"), "seconds": time.perf_counter() - started}


def measure(stage: str, recipe_overrides: list[str]) -> dict:
    """`child` in a subprocess (one stage per process, so nothing of another stage stays resident)."""
    return machine.child_json([sys.executable, __file__, "--child", stage, "--overrides", json.dumps(recipe_overrides)],
                              f"bench_plan: the {stage} measurement failed", env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                              tail=4000, with_stdout=True)


def predict(stage: str, recipe_overrides: list[str]) -> dict:
    """`eyas plan`'s figures for the same recipe on the CPU: named parts, device + host total (bytes)."""
    from eyas.cli.plan import read_config
    from eyas.config import load_recipe
    from eyas.data.memory import dump_need
    from eyas.memory import Hardware, shapes_of
    from eyas.train.memory import draft_size, train_need

    recipe = load_recipe(None, recipe_overrides)
    config = read_config(recipe)
    shapes, cpu = shapes_of(config), Hardware("cpu", None, 1, "cpu")
    if stage == "dump":
        need = dump_need(recipe, config, shapes, cpu)
    else:
        need = train_need(recipe, config, shapes, draft_size(recipe, config), cpu, "ddp", "no")
    return {"parts": {k: round(v) for k, v in {**need.device, **need.host}.items()}, "total": need.device_total + need.host_total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B-shaped target (full width)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sample and per training micro-batch")
    parser.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps (the 8B recipe's 7)")
    parser.add_argument("--dump-batch", type=int, default=8, help="samples per dump batch")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (the 8B recipe's 32000)")
    machine.add_report_args(parser, "bench_plan.json", "a tiny target and shapes, seconds; figures test the plumbing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    parser.add_argument("--child", choices=("dump", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.overrides))))
        return 0
    out = machine.output_path(args.out, RESULTS, args.smoke)
    machine.apply_smoke(args, "bench_plan", target=False, seq=64, ttt_steps=3, dump_batch=4, draft_vocab=128)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from eyas.config import load_recipe
    from eyas.data.prepare import prepare

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-plan-"))
    try:
        started = time.perf_counter()
        target = machine.tiny_target(root / "target") if args.smoke else build_target(root / "target", args.layers)
        samples = args.dump_batch + 1  # one dump batch of training samples; about a tenth held out
        write_chats(root / "chats.jsonl", samples, words=2 * args.seq)
        prepare(load_recipe(None, overrides(root, target, args, args.ttt_steps)))
        print(f"bench_plan: target and prepared data in {time.perf_counter() - started:.0f} s", flush=True)

        runs = {"dump": overrides(root, target, args, args.ttt_steps),
                "train": overrides(root, target, args, args.ttt_steps),
                "train_one_step": overrides(root, target, args, 1)}
        results = {}
        for name, recipe_overrides in runs.items():
            measured = measure("dump" if name == "dump" else "train", recipe_overrides)
            predicted = predict("dump" if name == "dump" else "train", recipe_overrides)
            stage_bytes = (measured["peak_kib"] - measured["base_kib"]) * 1024
            results[name] = {**measured, "measured_bytes": stage_bytes, "predicted_bytes": round(predicted["total"]),
                             "predicted_parts": predicted["parts"], "ratio": stage_bytes / predicted["total"]}
            print(f"bench_plan: {name}: measured {stage_bytes / 2**30:.2f} GiB, predicted {predicted['total'] / 2**30:.2f} "
                  f"GiB (ratio {results[name]['ratio']:.3f}) in {measured['seconds']:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    deep, one = results["train"], results["train_one_step"]
    unroll_ratio = (deep["measured_bytes"] - one["measured_bytes"]) / (deep["predicted_bytes"] - one["predicted_bytes"])
    figures = {"plan_train_error": abs(deep["ratio"] - 1), "plan_dump_error": abs(results["dump"]["ratio"] - 1),
               "plan_unroll_error": abs(unroll_ratio - 1)}
    machine.write_json(out, {
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "runs": results, "unroll_ratio": round(unroll_ratio, 4),
        "definitions": {"measured_bytes": "VmHWM after the stage (reset once the target / trainer was built) minus VmRSS "
                                          "after imports, of a fresh process per stage",
                        "predicted_bytes": "eyas.cli.plan device total + host total for the same recipe, Hardware('cpu')",
                        "plan_unroll_error": "|(measured deep - measured one-step) / (predicted deep - predicted one-step) - 1|"},
        "settings": {"target": "tiny (benchmarks/machine.py)" if args.smoke else f"Llama-3.1-8B shape, {args.layers} layers",
                     "seq": args.seq, "ttt_steps": args.ttt_steps, "dump_batch_samples": args.dump_batch,
                     "draft_vocab_size": args.draft_vocab, "precision": "fp32", "device": "cpu", "smoke": args.smoke,
                     "train_steps_measured": 2},
        **machine.environment("transformers", "accelerate", "safetensors"),
    })
    machine.bench_lines(*machine.figure_lines(figures, {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
