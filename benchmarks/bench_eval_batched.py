"""A whole eval of a prompt set, one prompt at a time against many prompts at once (`eval.batch_size`),
side by side in one run: the same prompts, drafts, shapes and baseline, the same `evaluate` call with
batch_size 1 and batch_size B, alternated `--repeats` times (medians).

    python benchmarks/bench_eval_batched.py --threads 1 --repeats 1   # SmolLM2 fp32, 26 prompts x 64 new tokens,
                                         # chain:3 + chain:5 + the target alone, batch 26 (about 10 minutes)
    python benchmarks/bench_eval_batched.py --draft runs/quickstart/checkpoints/best   # a trained draft
    python benchmarks/bench_eval_batched.py --smoke    # seconds: a tiny target, 4 prompts, 8 tokens

The draft: `--draft` when given; else the quickstart's best checkpoint when runs/quickstart has one;
else an eagle3 head at initialisation (its embedding, lm_head and norm copied from the target, the
rest random: it is rejected almost always, so the figures are the decoder's cost with a head-sized
draft, not a trained draft's speedup). Which one ran is printed and recorded.
Figures: eval seconds = wall-clock time of `evaluate` (warm-up, baseline and every configuration);
prompts/s = prompts / eval seconds; speedup = one-at-a-time seconds / batched seconds. At T=0 the
batched outputs are compared with the target's own greedy outputs (`greedy_match`).
Prints `BENCH` lines and writes benchmarks/results/bench_eval_batched.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine import add_report_args, apply_smoke, bench_lines, command_line, environment, output_path, set_threads, write_json

RESULTS = Path(__file__).parent / "results" / "bench_eval_batched.json"
BROAD = Path(__file__).parent / "prompts" / "broad.jsonl"
QUICKSTART = Path("runs/quickstart")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", help="checkpoint directory or truncated:N (default: see the docstring)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", default=["chain:3", "chain:5"])
    parser.add_argument("--prompts", default=str(BROAD))
    parser.add_argument("--max-prompts", type=int, default=26)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=0, help="rows per batch (0: every prompt in one batch)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default, as eval runs; 1: steadier on a shared machine)")
    add_report_args(parser, "bench_eval_batched.json", "seconds: a tiny target, 4 prompts, 8 tokens, 1 repeat")
    args = parser.parse_args(argv)
    apply_smoke(args, "bench_eval_batched", max_prompts=4, max_new_tokens=8, repeats=1)
    return args


def init_head(target, tokenizer, folder: Path) -> Path:
    """An eagle3 head at initialisation for this target, saved as a draft directory."""
    import torch

    from eyas.draft.checkpoint import save_draft
    from eyas.draft.features import default_layers
    from eyas.draft.registry import build_head
    from eyas.recipe_schema import DraftConfig
    from eyas.targets import target_identity

    torch.manual_seed(0)
    config = target.config
    head = build_head(DraftConfig(kind="eagle3", num_steps=5), config, default_layers(config.num_hidden_layers), None,
                      target_identity(config, tokenizer))
    head.init_from_target(target)
    return save_draft(folder, head.to(target.dtype), {"step": 0})


def pick_draft(args, target, tokenizer, scratch: Path) -> tuple[str, str]:
    """(draft spec, what it is)."""
    from eyas.train.checkpoint import best_checkpoint

    if args.draft:
        return args.draft, "given by --draft"
    best = best_checkpoint(QUICKSTART) if QUICKSTART.is_dir() and not args.smoke else None
    if best is not None:
        return str(best), "the quickstart's trained draft"
    return str(init_head(target, tokenizer, scratch / "eagle3_init")), "an eagle3 head at initialisation (untrained)"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from eyas.decode import SamplingParams
    from eyas.eval.drafts import make_draft
    from eyas.eval.prompts import load_prompts, render
    from eyas.eval.runner import EncodedPrompt, evaluate
    from eyas.recipe_schema import TargetConfig
    from eyas.shapes import parse_shape
    from eyas.targets import load_target

    set_threads(args.threads)
    target, tokenizer = load_target(TargetConfig(path=args.target, dtype=args.dtype))
    greedy = SamplingParams(0.0)
    scratch = Path(tempfile.mkdtemp(prefix="eyas-bench-eval-batched-"))
    spec, what = pick_draft(args, target, tokenizer, scratch)
    draft = make_draft(spec, target, tokenizer, greedy)
    shapes = [parse_shape(s) for s in args.shapes]
    loaded, _ = load_prompts(args.prompts, None, args.max_prompts)
    prompts = [EncodedPrompt(p, render(p, tokenizer)) for p in loaded]  # first turns: no target answers needed
    batch = args.batch_size or len(prompts)
    print(f"# target {args.target} ({args.dtype}), draft {draft.name}: {what}; {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, shapes {args.shapes} + the target alone; batch {batch}; "
          f"{torch.get_num_threads()} threads", flush=True)

    runs = {"one_at_a_time": [], "batched": []}
    reports = {}
    for repeat in range(args.repeats):
        for mode, size in (("one_at_a_time", 1), ("batched", batch)):  # alternated: load drifts hit both
            start = time.perf_counter()
            reports[mode] = evaluate(target, tokenizer, [draft], shapes, prompts, greedy, args.max_new_tokens,
                                     progress=False, batch_size=size)
            runs[mode].append(time.perf_counter() - start)
            print(f"# repeat {repeat + 1}: {mode} {runs[mode][-1]:.1f} s", flush=True)
    seconds = {mode: statistics.median(v) for mode, v in runs.items()}
    speedup = seconds["one_at_a_time"] / seconds["batched"]
    configs = {}
    for mode, report in reports.items():
        for config in report["configs"]:
            overall = config["overall"]
            configs.setdefault(config["shape"], {})[mode] = {
                "tau": overall["tau"], "tokens": overall["tokens"], "prompts_per_s": overall["prompts_per_s"],
                "speedup_over_target": overall["speedup"], "greedy_match": overall.get("greedy_match"),
                "batched": config["batched"], "batch_note": config["batch_note"]}
        configs.setdefault("target alone", {})[mode] = {"prompts_per_s": report["baseline"]["overall"]["prompts_per_s"]}
    bench_lines(*(f"eval_{mode}_prompts_per_s {len(prompts) / seconds[mode]:.4f} prompts/s" for mode in runs),
                f"eval_batched_speedup {speedup:.3f} ratio")
    for shape, modes in configs.items():
        line = "  ".join(f"{mode} {m['prompts_per_s']:.3f} prompts/s" + (f" tau {m['tau']:.2f} greedy_match "
                                                                          f"{m['greedy_match']}" if "tau" in m else "")
                         for mode, m in modes.items())
        print(f"# {shape}: {line}")
    out = write_json(output_path(args.out, RESULTS, args.smoke, scratch), {
        "command": command_line(__file__, argv or None),
        "settings": {**vars(args), "batch_size": batch, "draft": spec, "draft_is": what, "prompts_used": len(prompts)},
        "eval_seconds": runs, "median_eval_seconds": seconds, "speedup": speedup,
        "prompts_per_s": {mode: len(prompts) / s for mode, s in seconds.items()}, "configs": configs,
        **environment("torch", "transformers"),
    })
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
