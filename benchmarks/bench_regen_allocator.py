"""What the memory allocator costs the target's own generation loop on a CPU (prepare's built-in back end).

Run: `python benchmarks/bench_regen_allocator.py [--rows 96] [--tokens 160]` (about 10 minutes on 2 CPU cores
for glibc and tcmalloc). `--smoke`: the tiny target, 4 rows of 8 tokens, its JSON in a temp folder or --out.

Each allocator runs in its own process (`LD_PRELOAD`; glibc is the default one), one after another: the
target in fp32, `--rows` greedy replies of `--tokens` tokens after a prompt of about 200 tokens, through
`eyas.data.regenerate.hf_generator` (the loop `eyas prepare` runs without an endpoint). It records tokens/s
and the process's user and system CPU seconds: the KV cache grows by one position per step, and an
allocator that maps and unmaps its large tensors spends the difference in page faults (system time).
Allocators whose library is not installed are listed as absent (Debian: libtcmalloc-minimal4,
libjemalloc2). Writes benchmarks/results/bench_regen_allocator.json and a `BENCH` line per allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from machine import ALLOCATORS, add_report_args, apply_smoke, bench_lines, child_json, environment, output_path, write_json

RESULTS = Path(__file__).parent / "results" / "bench_regen_allocator.json"
LIBRARIES = {"glibc": None, **ALLOCATORS}
PASSAGE = "Here is a long passage about the history of science, the growth of cities, and the ways people travel. "


def child(target: str, rows: int, tokens: int) -> dict:
    """One allocator's measurement, in this process (the parent chose its LD_PRELOAD)."""
    import time

    import torch

    from eyas.data.regenerate import hf_generator
    from eyas.recipe_schema import TargetConfig
    from eyas.targets import load_target

    model, tokenizer = load_target(TargetConfig(path=target, dtype="float32"))
    generate = hf_generator(model, tokenizer, tokens, 0.0, 0)
    prompts = [[{"role": "user", "content": PASSAGE * 8 + f"Question {i}: write a long essay about topic {i}."}]
               for i in range(rows)]
    before, started = os.times(), time.perf_counter()
    with torch.inference_mode():
        replies = generate(prompts)
    seconds, after = time.perf_counter() - started, os.times()
    written = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)
    return {"tokens": written, "seconds": seconds, "tokens_per_s": written / seconds,
            "user_s": after.user - before.user, "system_s": after.system - before.system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--allocators", nargs="+", default=["glibc", "tcmalloc"], choices=list(LIBRARIES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_report_args(parser, "bench_regen_allocator.json", "the tiny target, 4 rows of 8 tokens")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.target, args.rows, args.tokens)))
        return
    work = apply_smoke(args, "bench_regen_allocator", rows=4, tokens=8)
    out_path = output_path(args.out, RESULTS, args.smoke, work)
    results: dict[str, dict | None] = {}
    for name in args.allocators:
        library = LIBRARIES[name]
        if library and not Path(library).is_file():
            results[name] = None
            print(f"bench_regen_allocator: {name} absent ({library})", flush=True)
            continue
        env = {**os.environ, **({"LD_PRELOAD": library} if library else {})}
        results[name] = r = child_json([sys.executable, __file__, "--child", "--target", args.target, "--rows",
                                        str(args.rows), "--tokens", str(args.tokens)],
                                       f"bench_regen_allocator: the {name} run failed", env=env, tail=2000)
        bench_lines(f"regen_allocator_{name} {r['tokens_per_s']:.1f} tokens/s (user {r['user_s']:.0f} s, "
                    f"system {r['system_s']:.0f} s)")
    out = {"rows": args.rows, "tokens": args.tokens, "target": args.target, "smoke": args.smoke,
           "libraries": {n: LIBRARIES[n] for n in args.allocators}, "results": results,
           **environment("torch", "transformers")}
    write_json(out_path, out)
    print(f"bench_regen_allocator: wrote {out_path}")


if __name__ == "__main__":
    main()
