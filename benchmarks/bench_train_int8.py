"""Does training on 8-bit shards cost acceptance? eagle3 on SmolLM2 + chitchat, bf16 vs int8 shards.

Run: `python benchmarks/bench_train_int8.py` (about 15-25 minutes on 2 CPU cores; `--samples`,
`--steps`, `--ttt` for a bigger budget; `--smoke`: seconds, a tiny target, 24 conversations, 2 steps,
its JSON in a temp folder or --out).

The same prepared conversations are dumped twice (`dump.encoding` bf16 and int8, every other
setting equal), and the same eagle3 head (same seed, same data order, same budget) is trained
on each; the held-out simulated acceptance length (sum over k of the product of per-step
accuracies against the target's greedy token) of both is reported, with the relative gap.
The budget is small (a CPU), so the heads are far from converged; the comparison is paired
(everything but the feature encoding is identical), and a third run on the bf16 shards with
another seed gives the noise floor of the budget: a gap smaller than the seed-to-seed gap is
not distinguishable from noise at this budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from machine import add_report_args, apply_smoke, environment, linked_run, output_path, publish, stamp

RESULTS = Path(__file__).parent / "results" / "bench_train_int8.json"


def relative_gap(value: float, base: float) -> float:
    """value / base - 1; NaN when the base head accepted nothing (an untrained smoke-size head)."""
    return value / base - 1.0 if base else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=160, help="chitchat conversations (10%% held out)")
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--ttt", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--mixed-precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    add_report_args(parser, "bench_train_int8.json", "seconds: tiny target, 24 conversations, 2 steps, TTT 2")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    apply_smoke(args, "bench_train_int8", samples=24, max_length=64, steps=2, token_budget=256, ttt=2, draft_vocab=64)
    out = output_path(args.out, RESULTS, args.smoke)

    from eyas.config import load_recipe
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare
    from eyas.targets import load_target
    from eyas.train.loop import train

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-int8-"))
    common = [
        f"target.path={args.target}", f"run.output_dir={root}", "data.source=chitchat", f"data.max_samples={args.samples}",
        f"data.max_length={args.max_length}", "data.heldout_fraction=0.1", "dump.token_budget=2048",
        f"dump.draft_vocab_size={args.draft_vocab}", "draft.kind=eagle3", f"train.ttt_steps={args.ttt}",
        f"train.token_budget={args.token_budget}", f"train.max_steps={args.steps}", "train.lr=1e-3",
        "train.warmup_steps=10", "train.eval_every=0", "train.eval_batches=1000", "train.save_every=0",
        f"train.mixed_precision={args.mixed_precision}", "train.resume=false", "train.log_every=10",
    ]
    model, tokenizer = load_target(load_recipe(None, common).target)
    started = time.perf_counter()
    results = {}
    for encoding in ("bf16", "int8"):
        recipe = load_recipe(None, common + [f"run.name={encoding}", f"dump.encoding={encoding}"])
        if encoding == "bf16":
            prepare(recipe, tokenizer=tokenizer, model=model)
            prepared = recipe.run_dir / "prepared"
        else:
            shutil.copytree(prepared, recipe.run_dir / "prepared")
        t0 = time.perf_counter()
        manifest = dump(recipe, model=model, tokenizer=tokenizer)
        dump_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = train(recipe)
        results[encoding] = {
            "sim_accept": result["last_eval"]["sim_accept"],
            "step_accuracy": [result["last_eval"][f"acc_{k}"] for k in range(args.ttt)],
            "heldout_positions": result["last_eval"]["positions"],
            "bytes_per_token": manifest["bytes_per_token"], "dump_s": dump_s, "train_s": time.perf_counter() - t0,
            "train_tokens": json.loads((result["checkpoint"] / "trainer.json").read_text())["tokens"],
        }
        print(f"bench_train_int8: {encoding}: simulated acceptance {results[encoding]['sim_accept']:.4f}, "
              f"accuracy per step {results[encoding]['step_accuracy']}", flush=True)
    # The noise floor of this budget: the same bf16 shards, another seed (initialisation and data order).
    recipe = load_recipe(None, common + ["run.name=bf16_seed1", "dump.encoding=bf16", "run.seed=1"])
    linked_run(recipe.run_dir, root / "bf16")
    result = train(recipe)
    results["bf16_seed1"] = {"sim_accept": result["last_eval"]["sim_accept"],
                             "step_accuracy": [result["last_eval"][f"acc_{k}"] for k in range(args.ttt)]}
    seed_gap = relative_gap(results["bf16_seed1"]["sim_accept"], results["bf16"]["sim_accept"])
    print(f"bench_train_int8: bf16, seed 1: simulated acceptance {results['bf16_seed1']['sim_accept']:.4f}", flush=True)
    gap = relative_gap(results["int8"]["sim_accept"], results["bf16"]["sim_accept"])
    report = {
        "figures": {"sim_accept_bf16": results["bf16"]["sim_accept"], "sim_accept_int8": results["int8"]["sim_accept"],
                    "int8_relative_gap": gap, "seed_relative_gap": seed_gap, "runs": results, "seconds": time.perf_counter() - started},
        "settings": vars(args) | {"data": "chitchat", "loss": "forward_kl"},
        **environment(), "date": stamp(),
    }
    shutil.rmtree(root, ignore_errors=True)
    publish(out, report, [*(f"train_sim_accept_{e}_shards {results[e]['sim_accept']:.4f} tokens" for e in ("bf16", "int8")),
                          f"train_int8_vs_bf16_sim_accept_gap {100 * gap:+.2f} percent",
                          f"train_bf16_seed_to_seed_sim_accept_gap {100 * seed_gap:+.2f} percent"], "bench_train_int8", newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
