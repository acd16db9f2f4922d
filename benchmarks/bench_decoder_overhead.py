"""What the built-in decoder spends around the target's forwards: the target's time per verify
round against a bare forward of as many tokens, and the target-alone loop's time per token
against a bare one-token forward, side by side in one run.

    python benchmarks/bench_decoder_overhead.py                       # SmolLM2, truncated:4 draft, about 6 minutes
    python benchmarks/bench_decoder_overhead.py --threads 1 --clock cpu   # the figures a loaded machine can give
    python benchmarks/bench_decoder_overhead.py --draft runs/quickstart/checkpoints/step_N --prompts heldout \
        --run runs/quickstart                                         # the quickstart's draft on its held-out chat
    python benchmarks/bench_decoder_overhead.py --profile             # also torch.profiler's top ops of one decode
    python benchmarks/bench_decoder_overhead.py --smoke               # seconds: a tiny target, truncated:2

Definitions (all black-box: only the decoder's public `generate`/`target_decode` and the draft
protocol are used, so the same script measures any version of the decoder):
- decoder target time per round = (total - draft - prefill) / rounds, where draft is the time
  spent in the draft's start/expand/commit (timed here, around the draft object), and prefill
  the time of the same decode cut to one token (the prompt's forward and the first choice). It
  holds everything that is not the draft: mask, verify forward, verification, cache pruning.
- target loop time per token = (time of `target_decode` for N tokens - for 1 token) / (tokens - 1).
- prefill ratio: the decoder's one-token decode (its prompt forward) over `target_decode`'s.
- bare forward of n tokens: `model(input_ids [1, n], position_ids, cache)` with no mask, every
  position's logits, on a KV cache of the prompt plus half the generated tokens (the middle of
  the decode), cropped back after each call.
Per prompt, the bare forwards run `--repeats` times interleaved (median), then the target alone
and each shape decode once; the ratios are per prompt, the figures their medians over prompts.
`--clock wall` (default) times wall-clock seconds; `--clock cpu` this process's CPU seconds,
which a shared machine's other jobs inflate far less (meaningful with `--threads 1` only: with
more threads it adds up their spinning at barriers).
Prints `BENCH` lines (with `uptime`'s load beside them) and writes
benchmarks/results/bench_decoder_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import machine  # benchmarks/machine.py

RESULTS = Path(__file__).parent / "results" / "bench_decoder_overhead.json"
SHAPES = ["chain:4", "dynamic:depth=5,topk=4,nodes=12"]  # the quickstart's shapes


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    machine.add_decode_args(parser, dtype="float32", shapes=SHAPES, max_prompts=6, max_new_tokens=48)
    parser.add_argument("--draft", default="truncated:4", help="checkpoint directory or truncated:N")
    parser.add_argument("--repeats", type=int, default=5, help="bare forwards per prompt and length (median)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall-clock seconds, or this process's CPU seconds (with --threads 1)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops for one decode per shape")
    machine.add_report_args(parser, "bench_decoder_overhead.json", "seconds: a tiny target, truncated:2, 2 prompts, 8 tokens")
    args = parser.parse_args(argv)
    machine.apply_smoke(args, "bench_decoder_overhead", draft="truncated:2", max_prompts=2, max_new_tokens=8, repeats=1)
    return args


class TimedDraft:
    """The draft with its start/expand/commit timed (the draft protocol is public; the decoder is not touched)."""

    def __init__(self, draft, clock):
        self._draft, self._clock, self.seconds = draft, clock, 0.0

    def __getattr__(self, name):
        return getattr(self._draft, name)

    def _timed(self, method: str, *args):
        start = self._clock()
        try:
            return getattr(self._draft, method)(*args)
        finally:
            self.seconds += self._clock() - start

    def start(self, *args):
        return self._timed("start", *args)

    def expand(self, *args):
        return self._timed("expand", *args)

    def commit(self, *args):
        return self._timed("commit", *args)


def bare_forward_ms(model, prefix_ids: list[int], lengths: list[int], repeats: int, clock) -> dict[int, float]:
    """Median ms of a plain n-token forward (no mask, all logits) on a cache holding `prefix_ids`."""
    import torch

    from eyas.decode import cache_kwarg, new_cache

    kw = cache_kwarg(model)
    cache = new_cache()
    model(input_ids=torch.tensor([prefix_ids]), use_cache=True, **{kw: cache})
    start = len(prefix_ids)
    new_ids = torch.tensor([(prefix_ids * 8)[:max(lengths)]])
    seconds: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:  # interleaved, so a change of load hits every length alike
            t0 = clock()
            model(input_ids=new_ids[:, :n], position_ids=torch.arange(start, start + n)[None], use_cache=True,
                  **{kw: cache})
            seconds[n].append(clock() - t0)
            cache.crop(-n)  # back to the prefix
    return {n: 1000 * statistics.median(v) for n, v in seconds.items()}


def one_prompt(ids, model, decoders, draft: TimedDraft, eos, args, clock) -> dict:
    """Every figure for one prompt: bare forwards, the target loop, each shape's rounds."""
    from eyas.decode import SamplingParams
    from eyas.eval.decoder import target_decode

    greedy = SamplingParams(0.0)
    reference, loop_s = machine.timed(clock, target_decode, model, ids, args.max_new_tokens, greedy, eos)
    _, loop_prefill_s = machine.timed(clock, target_decode, model, ids, 1, greedy, eos)
    row = {"prompt_tokens": len(ids), "tokens": len(reference),
           "loop_ms_per_token": 1000 * (loop_s - loop_prefill_s) / max(len(reference) - 1, 1), "shapes": {}}
    verify_sizes = {}
    for spec, decoder in decoders.items():
        draft.seconds = 0.0
        result, total_s = machine.timed(clock, decoder.generate, ids, args.max_new_tokens)
        draft_s = draft.seconds
        _, prefill_s = machine.timed(clock, decoder.generate, ids, 1)
        rounds = max(result.rounds, 1)
        size = 1 + int(statistics.median(result.tree_sizes or [0]))
        verify_sizes[spec] = size
        row["shapes"][spec] = {
            "tokens": len(result.tokens), "rounds": result.rounds, "verify_tokens": size,
            "tau": 1 + sum(result.accepted) / rounds, "equal_to_target": result.tokens == reference,
            "target_ms_per_round": 1000 * (total_s - draft_s - prefill_s) / rounds,
            "draft_ms_per_round": 1000 * draft_s / rounds,
            "prefill_vs_target_prefill": prefill_s / loop_prefill_s,
            "speedup": (loop_s / len(reference)) / (total_s / len(result.tokens)),
        }
    middle = ids + reference[: len(reference) // 2]
    bare = bare_forward_ms(model, middle, sorted({1, *verify_sizes.values()}), args.repeats, clock)
    row["bare_ms"] = {str(n): v for n, v in bare.items()}
    row["loop_vs_bare"] = row["loop_ms_per_token"] / bare[1]
    for spec, size in verify_sizes.items():
        shape = row["shapes"][spec]
        shape["bare_ms"] = bare[size]
        shape["verify_vs_bare"] = shape["target_ms_per_round"] / bare[size]
    return row


def profile(model, decoders, ids, args) -> None:
    """torch.profiler over one decode per shape: where a round's time goes, op by op."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for spec, decoder in decoders.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.generate(ids, args.max_new_tokens)
        print(f"# profile of one decode, {spec}: top ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def median(values) -> float:
    return statistics.median(list(values))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from eyas.decode import SamplingParams, stop_token_ids
    from eyas.eval.decoder import SpeculativeDecoder
    from eyas.eval.drafts import make_draft
    from eyas.shapes import parse_shape

    load_before = os.getloadavg()
    model, tokenizer, dtype = machine.load_decode_target(args)
    greedy = SamplingParams(0.0)
    eos = stop_token_ids(model, tokenizer)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    draft = TimedDraft(make_draft(args.draft, model, tokenizer, greedy, target_path=args.target), clock)
    decoders = {spec: SpeculativeDecoder(model, draft, parse_shape(spec), greedy, eos) for spec in args.shapes}
    prompts = machine.encoded_prompts(args, tokenizer)
    started = time.time()
    rows = []
    with torch.inference_mode():
        warm_up = argparse.Namespace(**{**vars(args), "max_new_tokens": min(8, args.max_new_tokens), "repeats": 1})
        one_prompt(prompts[0], model, decoders, draft, eos, warm_up, clock)  # untimed: first-call allocations, kernel selection
        for index, ids in enumerate(prompts):
            rows.append(one_prompt(ids, model, decoders, draft, eos, args, clock))
            line = ", ".join(f"{s} {r['verify_vs_bare']:.2f}x" for s, r in rows[-1]["shapes"].items())
            print(f"prompt {index + 1}/{len(prompts)} ({len(ids)} tokens): loop {rows[-1]['loop_vs_bare']:.2f}x a "
                  f"1-token forward; rounds {line} a bare forward", flush=True)
        if args.profile:
            profile(model, decoders, prompts[0], args)
    load = (f"{args.clock} clock, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f} "
            f"(before {load_before[0]:.2f}) on {os.cpu_count()} cpus")
    figures = {"target_loop_vs_bare_forward": median(r["loop_vs_bare"] for r in rows),
               "loop_ms_per_token": median(r["loop_ms_per_token"] for r in rows),
               "bare_1_token_ms": median(r["bare_ms"]["1"] for r in rows), "shapes": {}}
    machine.bench_lines(f"target_loop_vs_bare_forward {figures['target_loop_vs_bare_forward']:.3f} ratio "
                        f"({figures['loop_ms_per_token']:.1f} ms/token against {figures['bare_1_token_ms']:.1f} ms; {dtype}; {load})")
    for spec in args.shapes:
        per = [r["shapes"][spec] for r in rows]
        shape = {key: median(p[key] for p in per) for key in
                 ("verify_vs_bare", "target_ms_per_round", "bare_ms", "draft_ms_per_round", "tau", "speedup",
                  "verify_tokens", "prefill_vs_target_prefill")}
        shape["equal_to_target"] = f"{sum(p['equal_to_target'] for p in per)}/{len(per)}"
        figures["shapes"][spec] = shape
        machine.bench_lines(f"decoder_verify_vs_bare_forward {shape['verify_vs_bare']:.3f} ratio {spec} "
                            f"({shape['target_ms_per_round']:.1f} ms/round against {shape['bare_ms']:.1f} ms for "
                            f"{shape['verify_tokens']:.0f} tokens; {dtype}; {load})",
                            f"decoder_prefill_vs_target_prefill {shape['prefill_vs_target_prefill']:.3f} ratio {spec} "
                            "(the prompt's forward and first token, decoder over target alone)",
                            f"decoder_speedup {shape['speedup']:.3f} x {spec} (tau {shape['tau']:.2f}, draft "
                            f"{shape['draft_ms_per_round']:.1f} ms/round, outputs equal to the target's {shape['equal_to_target']})")
    out = machine.write_json(machine.output_path(args.out, RESULTS, args.smoke), {
        **machine.run_record(__file__, argv), **machine.environment("transformers"), "seconds": round(time.time() - started, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"dtype_used": dtype},
        "figures": figures, "prompts": rows,
    }, newline=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
