"""`eyas eval`: speculative decoding with one or more drafts and shapes; table, JSON and plot.

    eyas eval RECIPE [section.key=value ...]
    eyas eval --target PATH --draft D [--draft D2] --prompts FILE --shapes chain:5 dynamic:depth=6,topk=8,nodes=32
              [--temperature 0] [--top-p 1] [--top-k 0] [--max-new-tokens 128] [--max-prompts 20] [--batch-size 1] [--out DIR]

A draft is a checkpoint directory (eagle, eagle3, mtp from `eyas train`), `truncated:N` (the
target's first N layers, a baseline draft) or `mixture:LAM` (a test draft of known acceptance).
Without --draft the recipe's eval.drafts, eval.checkpoint, or the run's best checkpoint is used.
Flags override the recipe's eval keys. Output: a terminal table, `report.json` and
`acceptance.png` in eval.output (default `<run_dir>/eval`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

from eyas import __version__, stages
from eyas.config import save_resolved
from eyas.decode import SamplingParams
from eyas.errors import EyasError
from eyas.eval.drafts import make_draft
from eyas.eval.engine_vllm import engine_eval, format_parity, require_vllm, resolve_engine
from eyas.eval.prompts import load_prompts
from eyas.eval.report import plot, print_report, write_json
from eyas.eval.runner import encode_prompts, evaluate
from eyas.eval.target_precision import EvalPrecision, choose
from eyas.precision import native_bf16
from eyas.recipe_checks import check_against_target
from eyas.recipe_schema import Recipe
from eyas.shapes import parse_shape
from eyas.stage_cli import stage_main, stage_parser
from eyas.targets import load_target, resolve_target_path
from eyas.train.checkpoint import best_checkpoint


def build_parser():
    parser = stage_parser("eyas eval", "Speculative decoding with draft heads: acceptance per depth, tau, speedup.",
                          recipe_required=False)
    parser.add_argument("--target", help="target model directory or alias (overrides target.path)")
    parser.add_argument("--draft", action="append", default=[], metavar="D",
                        help="draft checkpoint directory, truncated:N or mixture:LAM (repeat to compare)")
    parser.add_argument("--prompts", help="JSONL prompts (MT-bench turns, OpenAI messages) or 'heldout'")
    parser.add_argument("--shapes", nargs="+", metavar="SHAPE",
                        help="chain:K, chain:K,confidence=C, tree:[[0],[1],[0,0],...], dynamic:depth=D,topk=K,nodes=N")
    parser.add_argument("--temperature", help="0 = greedy (output identical to the target's)")
    parser.add_argument("--top-p", dest="top_p")
    parser.add_argument("--top-k", dest="top_k")
    parser.add_argument("--max-new-tokens", dest="max_new_tokens")
    parser.add_argument("--max-prompts", dest="max_prompts")
    parser.add_argument("--batch-size", dest="batch_size",
                        help="prompts decoded at once (eval.batch_size; 1 = one at a time, latency figures)")
    parser.add_argument("--out", help="output folder for report.json and acceptance.png (default: eval.output, else "
                        "<run_dir>/eval; with --target/--draft/--prompts/--shapes or sampling flags, "
                        "<run_dir>/eval/<UTC time> so the run's own report stays)")
    parser.add_argument("--no-baseline", action="store_true", help="do not time the target alone")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _flag_overrides(args) -> list[str]:
    """Flags as recipe overrides, so they are validated like any recipe key."""
    out = []
    if args.target:
        out.append(f"target.path={args.target}")
    if args.draft:
        out.append("eval.drafts=" + json.dumps(args.draft))
    if args.prompts:
        out.append(f"eval.prompts={args.prompts}")
    if args.shapes:
        out.append("eval.shapes=" + json.dumps(args.shapes))
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "max_prompts", "batch_size"):
        value = getattr(args, key)
        if value is not None:
            out.append(f"eval.{key}={value}")
    if args.out:
        out.append(f"eval.output={args.out}")
    if args.no_baseline:
        out.append("eval.baseline=false")
    return out


def _draft_specs(recipe) -> list[str]:
    if recipe.eval.drafts:
        return [str(d) for d in recipe.eval.drafts]
    if recipe.eval.checkpoint:
        return [recipe.eval.checkpoint]

    best = best_checkpoint(recipe.run_dir)
    if best is None:
        raise EyasError(f"no draft to evaluate: '{recipe.run_dir}/checkpoints' has none; train one with `eyas train`, "
                        "or pass --draft truncated:N (the target's first N layers) or --draft CHECKPOINT")
    return [str(best)]


def _machine(device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "cpu_threads": torch.get_num_threads()}
    if getattr(device, "type", "") == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def eval_precision(recipe: Recipe) -> EvalPrecision:
    """The precision `eval.target_dtype` picks for this machine (measured once where it is `auto`)."""
    return choose(recipe.target, recipe.eval.target_dtype, recipe.eval.temperature)


def _load_targets(recipe: Recipe, precision: EvalPrecision) -> tuple:
    """(target, tokenizer, the target alone's copy in its fastest precision or None where it is the same)."""
    target, tokenizer = load_target(dataclasses.replace(recipe.target, dtype=precision.dtype))
    if not recipe.eval.baseline or precision.baseline_dtype == precision.dtype:
        return target, tokenizer, None
    alone, _ = load_target(dataclasses.replace(recipe.target, dtype=precision.baseline_dtype))
    return target, tokenizer, alone


def run(recipe: Recipe, progress: bool = True, console=None) -> dict:
    """Evaluate a resolved recipe; writes report.json + acceptance.png and returns the report."""
    ev = recipe.eval
    shapes = [parse_shape(s) for s in ev.shapes]          # bad input fails before anything loads
    specs = _draft_specs(recipe)
    engine, engine_note = resolve_engine(ev.engine, specs, shapes, ev.temperature)
    if engine_note:
        print(f"eyas eval: eval.engine=auto: {engine_note}", flush=True)
    if engine == "vllm":
        require_vllm()
        if ev.temperature != 0:
            raise EyasError(f"eval.engine=vllm compares the two decoders at temperature 0; eval.temperature is "
                            f"{ev.temperature}: set eval.temperature=0")
    params = SamplingParams(ev.temperature, ev.top_p, ev.top_k)
    run_dir = recipe.run_dir if ev.prompts == "heldout" else None
    prompts, skipped = load_prompts(ev.prompts, run_dir, ev.max_prompts)
    precision = eval_precision(recipe)
    print(f"eyas eval: target precision {precision.reason}", flush=True)
    target, tokenizer, alone = _load_targets(recipe, precision)
    check_against_target(recipe, target.config)
    drafts = [make_draft(s, target, tokenizer, params, target_path=recipe.target.path) for s in specs]
    encoded, too_long = encode_prompts(prompts, tokenizer, target, ev.max_new_tokens, max(s.max_nodes for s in shapes),
                                       ev.answer_tokens)
    skipped.update(too_long)
    if not encoded:
        raise EyasError(f"all {len(prompts)} prompts are longer than the target's context allows with "
                        f"eval.max_new_tokens={ev.max_new_tokens}; lower it or use shorter prompts")
    results = evaluate(target, tokenizer, drafts, shapes, encoded, params, ev.max_new_tokens,
                       seed=recipe.run.seed, baseline=ev.baseline, progress=progress, batch_size=ev.batch_size,
                       baseline_target=alone)
    report = {
        "eyas_version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "target": {"name": recipe.target.path, "path": str(resolve_target_path(recipe.target.path)),
                   "dtype": str(target.dtype).replace("torch.", ""), "dtype_setting": ev.target_dtype,
                   "dtype_reason": precision.reason, "baseline_dtype": precision.baseline_dtype,
                   "precision_probe": precision.probe,
                   "native_bf16": native_bf16(target.device), "num_hidden_layers": target.config.num_hidden_layers,
                   "vocab_size": target.config.vocab_size},
        "settings": {"temperature": ev.temperature, "top_p": ev.top_p, "top_k": ev.top_k,
                     "max_new_tokens": ev.max_new_tokens, "seed": recipe.run.seed, "prompts": ev.prompts,
                     "prompts_loaded": len(prompts), "prompts_used": len(encoded), "skipped": skipped,
                     "drafts": specs, "shapes": [s.spec for s in shapes], "baseline": ev.baseline,
                     "batch_size": ev.batch_size, "engine": engine, "engine_setting": ev.engine,
                     "engine_note": engine_note},
        "machine": _machine(target.device),
        "definitions": {
            "alpha": "alpha[d-1] = P(draft token d accepted | tokens 1..d-1 accepted)",
            "cumulative": "cumulative[d-1] = P(at least d draft tokens accepted in a verify)",
            "tau": "mean tokens produced per target verify, counting the bonus token (plain decoding = 1)",
            "tau_from_alpha": "1 + sum_d prod_{j<=d} alpha_j",
            "tau_iid": "(1 - a^(K+1)) / (1 - a) with a = all accepts / all attempts (chains)",
            "speedup": "tokens/s over the target alone (bare KV-cache loop, prefill included on both sides), same prompts, same run",
            "prompts_per_s": "prompts decoded per second (at batch_size > 1 a batch's time is split evenly over its rows)",
        },
        **results,
        "recipe": recipe.to_dict(),
    }
    out_dir = Path(ev.output) if ev.output else recipe.run_dir / "eval"
    if engine == "vllm":
        report["vllm"] = engine_eval(specs, shapes, encoded, results, target, tokenizer, recipe.target.path,
                                     ev.max_new_tokens, out_dir, seed=recipe.run.seed)
    report["files"] = {"json": str(out_dir / "report.json"), "plot": str(out_dir / "acceptance.png")}
    write_json(report, out_dir / "report.json")
    plot(report, out_dir / "acceptance.png")
    save_resolved(recipe, out_dir)
    print_report(report, console)
    if report.get("vllm"):
        print(format_parity(report["vllm"]))
    print(f"wrote {out_dir / 'report.json'} and {out_dir / 'acceptance.png'}")
    return report


def main(argv: list[str] | None = None) -> int:
    def body(recipe, args) -> int:
        adhoc = [o for o in _flag_overrides(args) if not o.startswith("eval.output=")]
        if adhoc and not recipe.eval.output:
            # A comparison set up by flags gets a folder of its own; the run's report in <run_dir>/eval stays.
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
            own = dataclasses.replace(recipe.eval, output=str(recipe.run_dir / "eval" / stamp))
            recipe = dataclasses.replace(recipe, eval=own)
        inputs = _draft_specs(recipe) + ([recipe.eval.prompts] if recipe.eval.prompts != "heldout" else [])
        stages.run("eval", recipe, lambda: run(recipe, progress=not args.no_progress), force=args.force,
                   inputs=inputs)
        return 0

    return stage_main("eval", argv, body, parser=build_parser(), extra_overrides=_flag_overrides)


if __name__ == "__main__":
    sys.exit(main())
