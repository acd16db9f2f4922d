"""Speculative decoding on the SmolLM2 target: wall-clock speedup over the target's own greedy
`generate` (HF, KV cache) on the same prompts in the same process, next to tau, and the
decoder's bookkeeping share of wall time.

    python benchmarks/bench_decode.py                        # truncated-target draft, < 10 min on 2 cores
    python benchmarks/bench_decode.py --draft runs/x/checkpoints/best --shapes chain:5 dynamic:depth=6,topk=8,nodes=32
    python benchmarks/bench_decode.py --smoke                # seconds: a tiny target, truncated:2, 8 tokens

Every repeat decodes each prompt with the target alone and then with each configuration
(interleaved, so a drift in machine load hits both sides); the figures are medians over the
repeats. At T=0 each speculative output is checked token for token against the target's.
Default draft: the target's first 4 layers with its norm and lm_head (`truncated:4`), a real
LM that needs no training; on SmolLM2 it agrees with the target rarely and costs about a
third of a target forward (the 49152 x 576 lm_head dominates), so expect tau near 1 and a
speedup below 1 until a trained head is given with --draft.
Prints `BENCH <name> <value> <unit>` lines and writes benchmarks/results/bench_decode.json and
the acceptance curves of the last repeat to benchmarks/results/bench_decode.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from machine import add_report_args, apply_smoke, bench_lines, machine, output_path, run_record, set_threads, slug, versions, write_json

RESULTS = Path(__file__).parent / "results" / "bench_decode.json"

PROMPTS = [
    ("writing", "Write a short poem about the sea and the wind."),
    ("qa", "What are three good reasons to learn a second language?"),
    ("coding", "Write a Python function that checks whether a string is a palindrome."),
    ("roleplay", "You are a friendly tour guide in Paris. Greet a group of visitors."),
]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", action="append", default=[], help="checkpoint dir or truncated:N (repeatable)")
    parser.add_argument("--shapes", nargs="+", default=["chain:3", "dynamic:depth=4,topk=4,nodes=12"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a shared 2-core machine 2 threads oversubscribe)")
    add_report_args(parser, "bench_decode.json", "seconds: a tiny target, truncated:2, 8 tokens, one repeat")
    args = parser.parse_args(argv)
    apply_smoke(args, "bench_decode", draft=args.draft or ["truncated:2"], max_new_tokens=8, repeats=1)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from eyas.decode import SamplingParams
    from eyas.eval.drafts import make_draft
    from eyas.eval.prompts import Prompt
    from eyas.eval.runner import encode_prompts, evaluate
    from eyas.recipe_schema import TargetConfig
    from eyas.shapes import parse_shape
    from eyas.targets import load_target

    set_threads(args.threads)
    drafts_specs = args.draft or ["truncated:4"]
    target_cfg = TargetConfig(path=args.target)
    target, tokenizer = load_target(target_cfg)
    params = SamplingParams(args.temperature)
    shapes = [parse_shape(s) for s in args.shapes]
    drafts = [make_draft(s, target, tokenizer, params, target_path=args.target) for s in drafts_specs]
    prompts = [Prompt(str(i), cat, [{"role": "user", "content": text}]) for i, (cat, text) in enumerate(PROMPTS)]
    encoded, _ = encode_prompts(prompts, tokenizer, target, args.max_new_tokens, max(s.max_nodes for s in shapes))

    runs = []
    start = time.time()
    for repeat in range(args.repeats):
        result = evaluate(target, tokenizer, drafts, shapes, encoded, params, args.max_new_tokens,
                          seed=repeat, baseline=True, progress=False)
        runs.append(result)
        base = result["baseline"]["overall"]["tokens_per_s"]
        line = ", ".join(f"{c['label']}: tau {c['overall']['tau']:.2f} speedup {c['overall']['speedup']:.2f}x"
                         for c in result["configs"])
        print(f"repeat {repeat + 1}/{args.repeats}: target alone {base:.2f} tok/s; {line}", flush=True)

    figures = {"baseline_tokens_per_s": statistics.median(r["baseline"]["overall"]["tokens_per_s"] for r in runs)}
    per_config = {}
    for index, config in enumerate(runs[0]["configs"]):
        overall = [r["configs"][index]["overall"] for r in runs]
        match = [o.get("greedy_match") for o in overall]
        per_config[config["label"]] = {
            "speedup": statistics.median(o["speedup"] for o in overall),
            "tau": statistics.median(o["tau"] for o in overall),
            "alpha": overall[0]["alpha"],
            "tokens_per_s": statistics.median(o["tokens_per_s"] for o in overall),
            "bookkeeping_frac": statistics.median(o["time"]["bookkeeping_frac"] for o in overall),
            "draft_frac": statistics.median(o["time"]["draft_frac"] for o in overall),
            "target_frac": statistics.median(o["time"]["target_frac"] for o in overall),
            "greedy_match": (f"{sum(m['matched'] for m in match)}/{sum(m['compared'] for m in match)}"
                             if all(match) else None),
        }
    bench_lines(f"decode_baseline_tokens_per_s {figures['baseline_tokens_per_s']:.2f} tok/s")
    for label, f in per_config.items():
        name = slug(label)
        bench_lines(f"decode_speedup_{name} {f['speedup']:.2f} ratio", f"decode_tau_{name} {f['tau']:.2f} tokens/verify",
                    f"decode_bookkeeping_{name} {f['bookkeeping_frac']:.3f} fraction")
        if f["greedy_match"]:
            print(f"# {label}: greedy output identical to the target's on {f['greedy_match']} decodes; "
                  f"time split draft {f['draft_frac']:.0%} / target {f['target_frac']:.0%} / "
                  f"bookkeeping {f['bookkeeping_frac']:.1%}")
    out = output_path(args.out, RESULTS, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    from eyas.eval.report import plot

    curves = {"target": {"name": args.target},
              "settings": {"temperature": args.temperature, "prompts_used": len(encoded)},
              "configs": runs[-1]["configs"]}
    plot(curves, out.with_suffix(".png"))
    write_json(out, {
        **run_record(__file__, argv),
        "machine": machine() | {"device": str(target.device)},
        "versions": versions("transformers"),
        "settings": {"target": args.target, "smoke": args.smoke, "drafts": drafts_specs, "shapes": args.shapes,
                     "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "temperature": args.temperature,
                     "prompts": [p for _, p in PROMPTS]},
        "figures": figures, "configs": per_config, "seconds": time.time() - start,
        "runs": runs,
    }, newline=False, default=str)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
