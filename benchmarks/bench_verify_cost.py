"""What one target forward costs against how many new tokens it runs, in fp32 and bf16: the cost
model behind every speedup figure. A speculative round costs one verify over (root + draft
tokens) plus the draft's steps, and yields τ tokens; plain decoding costs one single-token
forward per token. So speedup ~= τ x t(1) / (t(n) + draft time).

    python benchmarks/bench_verify_cost.py                 # SmolLM2-135M-Instruct, about 3 minutes
    python benchmarks/bench_verify_cost.py --smoke         # seconds: a tiny target, a 16-token prefix, one repeat

Each repeat runs every (dtype, n) once, interleaved, on a KV cache holding a 100-token prefix
(the held-out chat prompts are 31-85 tokens); the figures are medians over the repeats.
Prints `BENCH` lines and writes benchmarks/results/bench_verify_cost.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

from machine import add_report_args, apply_smoke, bench_lines, environment, output_path, run_record, write_json

RESULTS = Path(__file__).parent / "results" / "bench_verify_cost.json"

NEW_TOKENS = [1, 2, 4, 5, 8, 13, 16, 32]
DTYPES = ["float32", "bfloat16"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prefix", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=9)
    add_report_args(parser, "bench_verify_cost.json", "seconds: a tiny target, a 16-token prefix, one repeat")
    args = parser.parse_args(argv)
    apply_smoke(args, "bench_verify_cost", prefix=16, repeats=1)

    import torch

    from eyas.decode import cache_kwarg, new_cache
    from eyas.eval.kv import tree_mask
    from eyas.recipe_schema import TargetConfig
    from eyas.targets import load_target

    models = {d: load_target(TargetConfig(path=args.target, dtype=d))[0] for d in DTYPES}
    generator = torch.Generator().manual_seed(0)
    vocab = models["float32"].config.vocab_size
    prefix_ids = torch.randint(0, vocab, (1, args.prefix), generator=generator)
    new_ids = torch.randint(0, vocab, (1, max(NEW_TOKENS)), generator=generator)
    prefilled = {}
    with torch.inference_mode():
        for dtype, model in models.items():
            cache = new_cache()
            model(input_ids=prefix_ids, use_cache=True, **{cache_kwarg(model): cache})
            prefilled[dtype] = cache

    def one_forward(dtype: str, n: int) -> float:
        model = models[dtype]
        cache = copy.deepcopy(prefilled[dtype])
        mask = tree_mask(model.config, args.prefix, torch.ones(n, n, dtype=torch.bool).tril(), list(range(n)), model.dtype,
                         model.device)
        positions = torch.arange(args.prefix, args.prefix + n)[None]
        start = time.perf_counter()
        model(input_ids=new_ids[:, :n], position_ids=positions, attention_mask=mask, use_cache=True,
              **{cache_kwarg(model): cache})
        return time.perf_counter() - start

    seconds = {(d, n): [] for d in DTYPES for n in NEW_TOKENS}
    with torch.inference_mode():
        for key in seconds:  # warm-up: first-call allocations and kernel selection
            one_forward(*key)
        for _ in range(args.repeats):
            for key in seconds:
                seconds[key].append(one_forward(*key))
    ms = {f"{d}:{n}": 1000 * statistics.median(v) for (d, n), v in seconds.items()}
    single = ms["float32:1"]
    bench_lines(*(f"forward_ms_{dtype}_{n}_tokens {ms[f'{dtype}:{n}']:.1f} ms ({ms[f'{dtype}:{n}'] / single:.2f} x fp32 one token)"
                  for dtype in DTYPES for n in NEW_TOKENS))
    out = write_json(output_path(args.out, RESULTS, args.smoke), {
        **run_record(__file__, argv), **environment("transformers"),
        "settings": {"target": args.target, "prefix": args.prefix, "repeats": args.repeats, "smoke": args.smoke},
        "median_ms": ms, "relative_to_fp32_one_token": {k: v / single for k, v in ms.items()},
    }, newline=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
