"""Parallel drafting in eyas's decoder: a peagle draft's time per round with the mask slots of every depth
in one forward (what the decoder does) against one forward per depth (drafting step by step), side by side.

    python benchmarks/bench_parallel_drafting.py --draft runs/kinds/peagle/checkpoints/best \\
        --prompts heldout --run runs/kinds/base            # the kinds study's peagle draft, held-out chat
    python benchmarks/bench_parallel_drafting.py --smoke   # seconds: a tiny target, a random peagle head

Per prompt and shape the decode runs twice, in alternating order: as the decoder runs it (it passes the
tree's depth with `plan_depth`, and the draft runs the slots of depths 1..depth-1 in one forward) and
with the same draft loaded again behind a wrapper whose `plan_depth` plans nothing (one slot per forward, the
cost of drafting step by step). Draft time per round is the decoder's own draft clock over its verify
rounds; the figures are medians over prompts of each prompt's ratio. Both variants' drafted tokens are
compared: in fp32 they are the same tokens (counts equal); in bf16 the two forward shapes may round a
near-tie apart, so the counts are reported. Prints `BENCH` lines and writes
benchmarks/results/bench_parallel_drafting.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import machine  # benchmarks/machine.py

RESULTS = Path(__file__).parent / "results" / "bench_parallel_drafting.json"
SHAPES = ["chain:3", "chain:5", "dynamic:depth=5,topk=4,nodes=12"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    machine.add_decode_args(parser, dtype="auto", shapes=SHAPES, max_prompts=13, max_new_tokens=40)
    parser.add_argument("--draft", help="a peagle checkpoint directory (required unless --smoke)")
    machine.add_report_args(parser, "bench_parallel_drafting.json", "seconds: a tiny target, a random peagle head, 2 prompts")
    args = parser.parse_args(argv)
    folder = machine.apply_smoke(args, "bench_parallel_drafting", dtype="float32", max_prompts=2, max_new_tokens=12)
    if folder:
        args.draft = str(random_peagle(folder))
    elif not args.draft:
        parser.error("--draft: give a peagle checkpoint directory (or --smoke)")
    return args


def random_peagle(folder: Path) -> Path:
    """A random peagle head on the smoke target, saved as a draft checkpoint (tests/fixtures.py)."""
    import torch

    from eyas.draft.checkpoint import save_draft

    head, _, _ = machine.tests_module("fixtures").random_head(folder / "target", "peagle")
    with torch.no_grad():
        head.mask_hidden.normal_()
    return save_draft(folder / "peagle", head, {"step": 0, "target_path": str(folder / "target")})


class StepByStep:
    """The draft with a `plan_depth` that plans nothing: the decoder's plan does not reach it, so each depth's slot
    runs alone (the wrapped draft is a copy of its own, never planned)."""

    def __init__(self, draft):
        self._draft = draft

    def __getattr__(self, name):
        return getattr(self._draft, name)

    def plan_depth(self, depth: int) -> None:
        """Nothing: the draft is left unplanned (one mask slot per forward)."""


def measure(target, drafts: dict, shape, prompts: list[list[int]], max_new_tokens: int, eos) -> dict:
    """Per prompt: each variant's draft ms per round, decode seconds and per-depth counts (alternating order)."""
    from eyas.decode import SamplingParams
    from eyas.eval.decoder import SpeculativeDecoder

    decoders = {name: SpeculativeDecoder(target, draft, shape, SamplingParams(0.0), eos) for name, draft in drafts.items()}
    for decoder in decoders.values():  # untimed warm-up of both paths
        decoder.generate(prompts[0], min(8, max_new_tokens))
    rows = []
    for index, prompt in enumerate(prompts):
        order = list(decoders) if index % 2 == 0 else list(decoders)[::-1]
        row = {}
        for name in order:
            result = decoders[name].generate(prompt, max_new_tokens)
            row[name] = {"draft_ms_per_round": 1000 * result.draft_s / len(result.accepted), "seconds": result.total_s,
                         "rounds": len(result.accepted), "accepted": result.accepted, "tokens": result.tokens}
        rows.append(row)
    return summarize(rows)


def summarize(rows: list[dict]) -> dict:
    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rows)

    return {
        "parallel_draft_ms_per_round": median("parallel", "draft_ms_per_round"),
        "step_by_step_draft_ms_per_round": median("step_by_step", "draft_ms_per_round"),
        "draft_ratio": statistics.median(r["parallel"]["draft_ms_per_round"] / r["step_by_step"]["draft_ms_per_round"]
                                         for r in rows),
        "decode_ratio": statistics.median(r["parallel"]["seconds"] / r["step_by_step"]["seconds"] for r in rows),
        "rounds": {name: sum(r[name]["rounds"] for r in rows) for name in ("parallel", "step_by_step")},
        "same_tokens": sum(r["parallel"]["tokens"] == r["step_by_step"]["tokens"] for r in rows),
        "same_counts": sum(r["parallel"]["accepted"] == r["step_by_step"]["accepted"] for r in rows),
        "prompts": len(rows),
    }


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from eyas.decode import SamplingParams, stop_token_ids
    from eyas.draft.checkpoint import read_draft_config
    from eyas.errors import EyasError
    from eyas.eval.drafts import make_draft
    from eyas.shapes import parse_shape

    if read_draft_config(args.draft)["kind"] != "peagle":
        raise EyasError(f"--draft {args.draft} is not a peagle draft: only a parallel drafter has mask slots to plan")
    target, tokenizer, dtype = machine.load_decode_target(args)
    eos = stop_token_ids(target, tokenizer)
    greedy = SamplingParams(0.0)
    drafts = {name: wrap(make_draft(args.draft, target, tokenizer, greedy, target_path=args.target))
              for name, wrap in (("parallel", lambda d: d), ("step_by_step", StepByStep))}
    encoded = machine.encoded_prompts(args, tokenizer)
    figures = {}
    with torch.inference_mode():
        for spec in args.shapes:
            figures[spec] = f = measure(target, drafts, parse_shape(spec), encoded, args.max_new_tokens, eos)
            name = machine.slug(spec)
            machine.bench_lines(f"parallel_draft_ms_per_round_{name} {f['parallel_draft_ms_per_round']:.2f} ms",
                                f"step_by_step_draft_ms_per_round_{name} {f['step_by_step_draft_ms_per_round']:.2f} ms",
                                f"parallel_vs_step_by_step_draft_{name} {f['draft_ratio']:.3f} ratio",
                                f"parallel_vs_step_by_step_decode_{name} {f['decode_ratio']:.3f} ratio")
            print(f"# {spec}: same tokens on {f['same_tokens']}/{f['prompts']} prompts, same per-round counts on "
                  f"{f['same_counts']}/{f['prompts']} ({dtype})", flush=True)
    out = machine.write_json(machine.output_path(args.out, RESULTS, args.smoke), {
        **machine.environment("torch", "transformers"),
        "settings": {"target": args.target, "draft": args.draft, "dtype": dtype, "prompts": args.prompts,
                     "max_prompts": args.max_prompts, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                     "smoke": args.smoke},
        "figures": figures})
    print(f"# results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
