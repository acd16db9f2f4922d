"""Fuzzed inputs benchmark: how many structured-but-wrong inputs eyas's parsers take without a traceback.

Run: `python benchmarks/bench_fuzz_inputs.py` (2,000 inputs per parser, 6.5 minutes on 2 shared CPU cores;
`--examples N` for another count, `--seed S` for other inputs). Writes benchmarks/results/bench_fuzz_inputs.json.
`--smoke`: 30 inputs per parser, seconds, its JSON in a temp folder (or --out).

The parsers and the property are tests/fuzz_inputs.py's, the ones tests/test_fuzz_inputs.py
holds in the fast suite on fewer inputs: the recipe loader and its overrides, the chat-row reader,
the eval prompt-file reader, and a real small dump with one file damaged (manifest, sidecar,
index, shard bytes or safetensors header) opened and read in full. Each input either succeeds
with a well-formed result, or is a counted skip, or raises one `EyasError` line; anything else
counts as a traceback (its type, where it was raised and its input are listed). Prints one
`BENCH fuzz_inputs_<parser> ...` line per parser, then `BENCH fuzz_inputs <n> tried, <k> tracebacks`;
exits 1 if k > 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import add_report_args, apply_smoke, bench_lines, command_line, environment, output_path, tests_module, write_json

RESULTS = Path(__file__).parent / "results" / "bench_fuzz_inputs.json"


def fuzz(name: str, examples: int, seed: int, work: Path) -> dict:
    """Run one parser's check on `examples` generated inputs, catching what escapes it instead of stopping."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    fuzz_inputs = tests_module("fuzz_inputs")  # the parsers' strategies and checks: tests/fuzz_inputs.py
    describe = fuzz_inputs.describe
    strategy, check = fuzz_inputs.PARSERS[name]
    tried, outcomes, faults, first = 0, Counter(), Counter(), {}

    @fixed_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        nonlocal tried
        tried += 1
        try:
            outcomes[check(work, case)] += 1
        except Exception as exc:  # the count is the point: every input runs, each fault is recorded
            line = describe(exc)
            faults[line] += 1
            first.setdefault(line, repr(case)[:400])

    started = time.perf_counter()
    run()
    return {"tried": tried, "tracebacks": sum(faults.values()), "seconds": round(time.perf_counter() - started, 1),
            "outcomes": dict(outcomes.most_common()),
            "faults": [{"fault": line, "count": n, "input": first[line]} for line, n in faults.most_common()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="inputs per parser")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed, the same inputs)")
    parser.add_argument("--parsers", default="recipe,chat_rows,prompts,shards", help="comma list of parsers")
    add_report_args(parser, "bench_fuzz_inputs.json", "30 inputs per parser, JSON in a temp folder")
    args = parser.parse_args()
    apply_smoke(args, "bench_fuzz_inputs", target=False, examples=30)

    results = {}
    with tempfile.TemporaryDirectory(prefix="eyas-fuzz-") as folder:
        for name in args.parsers.split(","):
            work = Path(folder) / name
            work.mkdir()
            result = results[name] = fuzz(name, args.examples, args.seed, work)
            seen = ", ".join(f"{n} {outcome}" for outcome, n in result["outcomes"].items())
            bench_lines(f"fuzz_inputs_{name} {result['tried']} tried, {result['tracebacks']} tracebacks "
                        f"({seen}; {result['seconds']} s)")
            for fault in result["faults"]:
                print(f"  {fault['count']} x {fault['fault']}\n    first input: {fault['input']}", flush=True)
    tried = sum(r["tried"] for r in results.values())
    tracebacks = sum(r["tracebacks"] for r in results.values())
    bench_lines(f"fuzz_inputs {tried} tried, {tracebacks} tracebacks")

    record = {"command": command_line(__file__), "examples_per_parser": args.examples, "seed": args.seed, "tried": tried,
              "tracebacks": tracebacks, "parsers": results, **environment("hypothesis", "pyyaml", "safetensors")}
    out = write_json(output_path(args.out, RESULTS, args.smoke), record)
    print(f"wrote {out}")
    return 1 if tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())
