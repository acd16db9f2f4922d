"""The training levers, each against the base at equal data and optimizer steps, on one run's data.

    python benchmarks/study_levers.py --data runs/quickstart            # train, eval, report
    python benchmarks/study_levers.py --data runs/quickstart --stage train --only lk init-target
    python benchmarks/study_levers.py --data runs/quickstart --stage report
    python benchmarks/study_levers.py --smoke       # seconds: base at 2 steps on a tiny quickstart run

`--data` is a finished run (the quickstart's, or any eagle3 run): its `recipe.yaml`, `prepared/`
and `shards/` are the base. Every variant below is that recipe plus the overrides its name says
and `train.max_steps=--steps`, so all of them see the same tokens in the same order (seed 0);
`base-seed1` and `base-seed2` differ from `base` only in `run.seed` (the init and the data order) and
give the seed-to-seed spread a lever must beat. Each training run's wall clock is recorded (the
deeper unrolls cost more per step; that is stated, not hidden).

Eval decodes every draft of a group in one process, interleaved prompt by prompt
(eyas.eval.runner), at T=0 on the run's held-out chat and on two prompts of each of the 13
categories of `benchmarks/prompts/broad.jsonl` (both turns of the two-turn ones): the eagle3
variants with `chain:4`, the 3-layer mtp heads beside the eagle3 base with `chain:3`, and the
head kinds side by side (`kinds`: eagle3, mtp, peagle, dflash and dspark, each from its best start) with
`chain:3`, and the tree-aware variants (`tree*`: eagle3 from the target's last layer, chosen for a 3-deep dynamic
tree of width 4, with each tree lever and without, two seeds) on that tree (`tree`) and on `chain:3`
(`tree-chain`). `--vllm` also serves every draft a plain vLLM serves (all but mtp and dspark) through
`eval.engine=vllm`: vLLM's τ and speedup over its own target alone, beside eyas's. Each row also
has the draft's time per round and its share of the decode. Results go to
benchmarks/results/study_levers.{json,md}, with a `BENCH` line per variant, group and suite.

    python benchmarks/study_levers.py --data runs/quickstart --only init-target mtp3-target peagle dflash dspark \
        --groups kinds --vllm --tag kinds
    python benchmarks/study_levers.py --data runs/quickstart --only tree tree-s1 tree-topk tree-topk-s1 \
        tree-sibling tree-sibling-s1 tree-align tree-align-s1 --groups tree tree-chain --tag tree
    python benchmarks/study_levers.py --data runs/quickstart --out runs/tree-mtp --only tree-mtp tree-mtp-s1 \
        tree-mtp-topk tree-mtp-topk-s1 tree-mtp-align tree-mtp-align-s1 --groups tree tree-chain --tag tree_mtp
    python benchmarks/study_levers.py --data runs/quickstart --out runs/tree --only tree tree-s1 ... --stage rescore
`--stage rescore` runs the trainer's held-out eval, as this code computes it, on each variant's last checkpoint
(runs trained before the eval changed); the report then gives that figure beside the logged one and, per group and
suite, how each ranks the drafts against their decoded τ (Spearman's rho, `figure_agreement`).
`--smoke` runs the same stages on a tiny quickstart run it prepares and dumps itself (tests/fixtures.py's
tiny target): `base` for 2 steps, the eagle3 group, 4 prompts of 8 tokens per suite; everything,
results included, goes to a temp folder (or --out).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from machine import BROAD_PROMPTS as BROAD
from machine import REPO as ROOT
from machine import RESULTS, apply_smoke, bench_lines, environment, eyas_stage, linked_run, smoke_dir, stamp, tiny_run, write_json

# the tree the tree-aware variants are chosen for and measured on (3 deep: the unroll's depth)
TREE = "dynamic:depth=3,topk=4,nodes=12"
# variant -> overrides of the base run's recipe (besides train.max_steps and the run name)
VARIANTS = {
    "base": [],
    "base-seed1": ["run.seed=1"],
    "base-seed2": ["run.seed=2"],
    "init-target": ["train.draft_init=target_last_layer"],
    "lk": ["train.loss=lk"],
    "kl+lk": ["train.loss=forward_kl:0.5,lk:0.5"],
    "ttt5": ["train.ttt_steps=5"],
    "ttt5-ramp": ["train.ttt_steps=5", "train.ttt_ramp_steps=100"],
    "norm-variants": ["draft.eagle3_norm_before_fc=true", "draft.eagle3_norm_before_residual=true", "export.to=vllm"],
    # the winners together
    "init+kl+lk": ["train.draft_init=target_last_layer", "train.loss=forward_kl:0.5,lk:0.5"],
    "init+norms": ["train.draft_init=target_last_layer", "draft.eagle3_norm_before_fc=true",
                   "draft.eagle3_norm_before_residual=true", "export.to=vllm"],
    # mtp on the same shards (they hold the last hidden state every kind reads): feeds and init
    "mtp3-chain": ["draft.kind=mtp", "draft.num_steps=3", "draft.mtp_feed=chain"],
    "mtp3-target": ["draft.kind=mtp", "draft.num_steps=3", "draft.mtp_feed=target"],
    # the number of mtp heads (each one more layer trained per step, and one more step it can draft)
    "mtp2-target": ["draft.kind=mtp", "draft.num_steps=2", "draft.mtp_feed=target", "train.ttt_steps=2"],
    "mtp5-target": ["draft.kind=mtp", "draft.num_steps=5", "draft.mtp_feed=target", "train.ttt_steps=5"],
    "mtp3-target-init": ["draft.kind=mtp", "draft.num_steps=3", "draft.mtp_feed=target",
                         "train.draft_init=target_last_layer"],
    # the parallel drafters (one draft forward per round), started from the target's last layer as eagle3
    # (init-target) is
    "peagle": ["draft.kind=peagle", "train.draft_init=target_last_layer"],
    "dflash": ["draft.kind=dflash", "draft.num_steps=3", "train.draft_init=target_last_layer"],
    # DSpark: 3 drafts per block as dflash's 3 mask slots, its published loss (its registry line's defaults)
    "dspark": ["draft.kind=dspark", "draft.num_steps=3", "train.draft_init=target_last_layer"],
    # training for a tree (issue: tree-aware objective): eagle3 from the target's last layer, every variant chosen
    # for and measured on the same dynamic tree (its width 4 is each lever's); `-s1`, `-s2` variants: the same at
    # run.seed=1, 2
    **{f"tree{lever}{seed}": ["train.draft_init=target_last_layer", f"train.select_shape={TREE}", *overrides,
                              *([f"run.seed={seed[-1]}"] if seed else [])]
       for lever, overrides in (("", []), ("-topk", ["train.loss=forward_kl:1,topk:1"]),
                                ("-sibling", ["train.sibling_feed=true"]), ("-align", ["train.align_mask=true"]),
                                ("-align-sibling", ["train.align_mask=true", "train.sibling_feed=true"]))
       for seed in ("", "-s1", "-s2")},
    # the same for mtp (3 heads, target feed, random init as mtp3-target): the levers its data feed allows (a
    # sibling feed changes nothing where every head reads the target's tokens)
    **{f"tree-mtp{lever}{seed}": ["draft.kind=mtp", "draft.num_steps=3", "draft.mtp_feed=target",
                                  f"train.select_shape={TREE}", *overrides, *([f"run.seed={seed[-1]}"] if seed else [])]
       for lever, overrides in (("", []), ("-topk", ["train.loss=forward_kl:1,topk:1"]),
                                ("-align", ["train.align_mask=true"]))
       for seed in ("", "-s1", "-s2")},
}
PER_CATEGORY = 2
EVAL_TOKENS = 40


def kind_of(name: str) -> str:
    """The head kind a variant trains (its draft.kind override, else the base's eagle3)."""
    return next((o.split("=", 1)[1] for o in VARIANTS[name] if o.startswith("draft.kind=")), "eagle3")


# the kinds side by side at equal data and steps, each in its best start found above: eagle3, peagle, dflash and
# dspark from the target's last layer, mtp (3 layers, target feed) from a random init, which beat the copy
KINDS_SIDE_BY_SIDE = ("init-target", "mtp3-target", "peagle", "dflash", "dspark")
# eval groups: the eagle3 variants drafting 4 deep; the 3-layer mtp heads (which cannot go deeper)
# beside the eagle3 base, all 3 deep; the four kinds 3 deep (dflash's 3 mask slots)
GROUPS = {"eagle3": ("chain:4", lambda name: kind_of(name) == "eagle3" and not name.startswith("tree")),
          "depth3": ("chain:3", lambda name: kind_of(name) == "mtp" or name == "base"),
          "kinds": ("chain:3", lambda name: name in KINDS_SIDE_BY_SIDE),
          # training for a tree: its variants on the tree they were chosen for, and on a chain as deep
          "tree": (TREE, lambda name: name.startswith("tree")),
          "tree-chain": ("chain:3", lambda name: name.startswith("tree"))}


def run_overrides(out: Path, name: str, steps: int) -> list[str]:
    return [f"run.output_dir={out}", f"run.name={name}", f"train.max_steps={steps}", "train.eval_every=0",
            "train.save_every=0"]


def stage_train(data: Path, out: Path, names: list[str], steps: int, timings: dict, extra: list[str] | None = None) -> None:
    for name in names:
        run = out / name
        if (run / "checkpoints" / "best").is_dir():
            continue
        linked_run(run, data, fresh=False)
        overrides = run_overrides(out, name, steps) + (extra or []) + VARIANTS[name]
        timings[f"train:{name}"] = eyas_stage("train", data / "recipe.yaml", overrides, out / f"{name}.train.log", "levers")


def broad_subset(path: Path, per_category: int = PER_CATEGORY) -> Path:
    """The first `per_category` prompts of each category of the broad set, written to `path`."""
    kept, seen = [], {}
    for line in BROAD.read_text().splitlines():
        row = json.loads(line)
        seen[row["category"]] = seen.get(row["category"], 0) + 1
        if seen[row["category"]] <= per_category:
            kept.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(kept) + "\n")
    return path


SUITES = ("chat", "broad")


def stage_eval(data: Path, out: Path, names: list[str], timings: dict, groups: list[str],
               extra: list[str] | None = None, vllm: bool = False) -> None:
    from eyas.eval.engine_vllm import served_without_plugin

    prompts = {"chat": "heldout", "broad": str(broad_subset(out / "broad-subset.jsonl"))}
    linked_run(out / "base", data, fresh=False)  # the evals run as `base` (its held-out prompts), trained or not
    for group in groups:
        shape, member = GROUPS[group]
        for suite in SUITES:
            # drafts trained later are decoded in a run of their own (tau at T=0 does not depend on what
            # runs beside it); the reports on disk are never redone
            done = {c["draft"].split(":", 1)[0] for report in group_reports(out, group, suite) for c in report["configs"]}
            todo = [n for n in names if member(n) and n not in done]
            # --vllm: the drafts vLLM serves without a plugin go through eval.engine=vllm (eyas's decode of them,
            # then vLLM's over the same prompts, in one report); the others through eyas's decoder alone
            served = [n for n in todo if vllm and served_without_plugin(kind_of(n))]
            for engine, members in (("vllm", served), ("builtin", [n for n in todo if n not in served])):
                if not members:
                    continue
                drafts = [str(out / n / "checkpoints" / "best") for n in members]
                folder = out / "eval" / group / suite / str(len(list((out / "eval" / group / suite).glob("*/report.json"))))
                overrides = [f"run.output_dir={out}", "run.name=base", f"eval.prompts={prompts[suite]}",
                             "eval.max_prompts=0", f"eval.max_new_tokens={EVAL_TOKENS}", f"eval.engine={engine}",
                             "eval.temperature=0", f"eval.output={folder}", "eval.shapes=" + json.dumps([shape]),
                             "eval.drafts=" + json.dumps(drafts), *(extra or [])]
                timings[f"eval:{group}:{suite}:{engine}"] = eyas_stage("eval", data / "recipe.yaml", overrides,
                                                                        out / f"eval-{group}-{suite}.log", "levers")


RESCORED = "heldout_rescored.json"  # under <run>/logs/: the held-out eval of the run's last checkpoint by today's code


def stage_rescore(out: Path, names: list[str]) -> None:
    """Each variant's last checkpoint scored again by this code's held-out eval (the trainer's own, as a run logs
    it today), into <run>/logs/heldout_rescored.json: runs trained before the eval changed, compared under it."""
    from eyas.config import load_recipe
    from eyas.train.loop import Trainer

    for name in names:
        run = out / name
        path = run / "logs" / RESCORED
        if path.is_file() or not (run / "checkpoints" / "recipe.yaml").is_file():
            continue
        print(f"levers: the held-out eval of {name}'s last checkpoint, by this code", flush=True)
        trainer = Trainer(load_recipe(run / "checkpoints" / "recipe.yaml", []))
        trainer.resume()
        path.write_text(json.dumps({"step": trainer.state.step, **trainer.evaluate()}, indent=1) + "\n")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = float(position)
    return ranks


def rank_agreement(figure: list[float], tau: list[float]) -> float | None:
    """Spearman's rank correlation of a held-out figure with the decoded tau over the same drafts (no ties)."""
    if len(figure) < 3:
        return None
    a, b = _ranks(figure), _ranks(tau)
    mean = (len(a) - 1) / 2
    return sum((x - mean) * (y - mean) for x, y in zip(a, b)) / sum((x - mean) ** 2 for x in a)


def figure_agreement(rows: list[dict]) -> dict:
    """Per group and suite: how the logged and (where present, for the tree the drafts were chosen for) the
    rescored held-out figure of the group's shape rank the drafts against their decoded tau."""
    agreement = {}
    for group in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == group]
        for suite in SUITES:
            scored = [r for r in members if f"tau_{suite}" in r]
            tau = [r[f"tau_{suite}"] for r in scored]
            entry = {"drafts": len(scored), "logged": rank_agreement([_held(r) for r in scored], tau)}
            if scored and all(_rescored(r) is not None for r in scored):
                entry["rescored"] = rank_agreement([_rescored(r) for r in scored], tau)
            agreement[f"{group}:{suite}"] = entry
    return agreement


def _held(row: dict) -> float:
    """The held-out figure of the group's shape: the tree's where the variant was chosen for it, else the chain's."""
    return row["select_accept"] if row.get("select_shape") == row["shape"] else row["sim_accept"]


def _rescored(row: dict) -> float | None:
    """The re-scored figure of the tree the variant was chosen for, where the group is measured on that tree (the
    chain's figure did not change, so a chain group has none)."""
    return row.get("select_accept_rescored") if row.get("select_shape") == row["shape"] else None


def group_reports(out: Path, group: str, suite: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "eval" / group / suite).glob("*/report.json"))]


def held_out(run: Path) -> dict:
    """The trainer's last held-out evaluation (simulated acceptance, per-step accuracy)."""
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if r.get("kind") == "eval"][-1]
    rescored = run / "logs" / RESCORED
    return {"sim_accept": last["sim_accept"], "accuracy": [last[k] for k in sorted(last) if k.startswith("acc_")],
            **{key: last[key] for key in ("select_shape", "select_accept", "cover_width") if key in last},
            "cover": [last[k] for k in sorted(last) if k.startswith("cover_") and k != "cover_width"],
            **({"select_accept_rescored": json.loads(rescored.read_text())["select_accept"]} if rescored.is_file() else {})}


def stage_report(out: Path, names: list[str], steps: int, timings: dict, tag: str = "", results: Path = RESULTS) -> dict:
    rows = []
    for group, (shape, member) in GROUPS.items():
        reports = {s: group_reports(out, group, s) for s in SUITES}
        if not any(reports.values()):
            continue  # a group this study did not evaluate
        configs = {s: [c for report in reports[s] for c in report["configs"]] for s in SUITES}
        served = {s: {row["eyas_label"]: row for report in reports[s] for row in (report.get("vllm") or {}).get("rows", {}).values()}
                  for s in SUITES}
        for name in [n for n in names if member(n) and (out / n / "logs").is_dir()]:
            row = {"group": group, "shape": shape, "variant": name, "overrides": VARIANTS[name], **held_out(out / name),
                   "train_s": timings.get(f"train:{name}")}
            for suite in SUITES:
                config = next((c for c in configs[suite] if c["draft"].split(":", 1)[0] == name), None)  # "<run>:best"
                if config is None:
                    continue
                row[f"tau_{suite}"] = config["overall"]["tau"]
                time_s, rounds = config["overall"]["time"], config["overall"]["rounds"]
                row[f"draft_frac_{suite}"] = time_s["draft_frac"]  # the draft's share of the decode's wall time
                row[f"draft_ms_{suite}"] = 1000 * time_s["draft_s"] / rounds if rounds else None  # per round
                row[f"speedup_{suite}"] = config["overall"].get("speedup")
                if config["label"] in served[suite]:  # the same draft served by vLLM (eval.engine=vllm)
                    vllm_row = served[suite][config["label"]]["vllm"]
                    row[f"vllm_tau_{suite}"], row[f"vllm_speedup_{suite}"] = vllm_row["tau"], vllm_row["speedup"]
                if suite == "broad":
                    row["broad_per_category"] = {k: v["tau"] for k, v in config["per_category"].items()}
                    row["broad_per_turn"] = {k: v["tau"] for k, v in config["per_turn"].items()}
            rows.append(row)
    agreement = figure_agreement(rows)
    result = {"rows": rows, "figure_agreement": agreement, "steps": steps,
              "groups": {g: s for g, (s, _) in GROUPS.items()}, "eval_tokens": EVAL_TOKENS,
              "timings_s": timings, **environment("torch", "transformers"), "date": stamp()}
    stem = "study_levers" + (f"_{tag}" if tag else "")
    write_json(results / f"{stem}.json", result, indent=1, newline=False)
    table = markdown(rows)
    (results / f"{stem}.md").write_text(table)
    print(table)
    for r in rows:
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{r['group']}_{r['variant']}")
        bench_lines(f"levers_{name}_sim_accept {r['sim_accept']:.3f} tokens")
        for suite in SUITES:
            if f"tau_{suite}" in r:
                bench_lines(f"levers_{name}_tau_{suite} {r[f'tau_{suite}']:.3f} tokens/verify")
    for key, entry in agreement.items():
        for figure in ("logged", "rescored"):
            if entry.get(figure) is not None:
                bench_lines(f"levers_{re.sub(r'[^A-Za-z0-9]+', '_', key)}_{figure}_rank_agreement {entry[figure]:.3f} rho")
    print(f"levers: wrote {results / stem}.json and .md")
    return result


def markdown(rows: list[dict]) -> str:
    lines = ["| group | variant | shape | held-out sim. accept (rescored) | τ chat | τ broad | lowest broad category | "
             "draft ms/round (share), chat | speedup chat: eyas / vLLM (vLLM τ) | train s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    nan = float("nan")
    for r in rows:
        cats = r.get("broad_per_category") or {}
        low = min(cats.items(), key=lambda kv: kv[1]) if cats else ("", nan)
        draft = f"{r.get('draft_ms_chat') or nan:.1f} ({100 * (r.get('draft_frac_chat') or nan):.0f}%)"
        speed = f"{r.get('speedup_chat') or nan:.2f}x"
        if "vllm_speedup_chat" in r:
            speed += f" / {r['vllm_speedup_chat'] or nan:.2f}x ({r['vllm_tau_chat']:.3f})"
        held = f"{_held(r):.3f}" + (f" ({_rescored(r):.3f})" if _rescored(r) is not None else "")
        lines.append(f"| {r['group']} | {r['variant']} | {r['shape']} | {held} | {r.get('tau_chat', nan):.3f} | "
                     f"{r.get('tau_broad', nan):.3f} | {low[0]} {low[1]:.2f} | {draft} | {speed} | {r['train_s'] or 0:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a finished eagle3 run directory (recipe.yaml, prepared/, shards/)")
    parser.add_argument("--out", help="parent folder of the variants' runs (default runs/levers; --smoke: a temp folder, "
                        "which also takes the results)")
    parser.add_argument("--stage", choices=["train", "eval", "rescore", "report", "all"], default="all",
                        help="rescore (not in all): each variant's last checkpoint through today's held-out eval")
    parser.add_argument("--only", nargs="*", default=[], help="variants to run (default: all)")
    parser.add_argument("--steps", type=int, default=136, help="optimizer steps of every variant")
    parser.add_argument("--groups", nargs="*", choices=list(GROUPS), default=list(GROUPS), help="eval groups to run")
    parser.add_argument("--tag", default="", help="results go to study_levers_<tag>.{json,md} (another data set)")
    parser.add_argument("--train-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for every variant's training, before the variant's own (e.g. "
                             "train.mixed_precision=auto where the data's recipe asks for bf16 and it is not native)")
    parser.add_argument("--eval-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for the evals only (e.g. target.dtype=float32)")
    parser.add_argument("--vllm", action="store_true",
                        help="also serve every draft vLLM serves without a plugin in vLLM (eval.engine=vllm): its tau and "
                             "speedup over vLLM's target alone beside eyas's")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: base for 2 steps on a tiny quickstart run, the eagle3 group, 4 prompts of 8 tokens")
    args = parser.parse_args()
    results = RESULTS
    if args.smoke:
        apply_smoke(args, "study_levers", target=False, only=args.only or ["base"], steps=2, groups=["eagle3"],
                    eval_set=[*args.eval_set, "eval.max_prompts=4", "eval.max_new_tokens=8"])
        work = Path(args.out) if args.out else smoke_dir("study_levers")
        args.data = args.data or str(tiny_run(work / "data"))
        args.out, results = str(work / "levers"), work / "results"
    if not args.data:
        sys.exit("levers: --data RUN_DIR is required (a finished eagle3 run: recipe.yaml, prepared/, shards/)")
    data, out = Path(args.data).resolve(), Path(args.out or ROOT / "runs" / "levers").resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(args.only) - set(VARIANTS))
    if unknown:
        sys.exit(f"levers: unknown variant(s) {unknown}; variants: {', '.join(VARIANTS)}")
    names = args.only or list(VARIANTS)
    timing_file = out / "timings.json"
    timings = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
    try:
        if args.stage in ("train", "all"):
            stage_train(data, out, names, args.steps, timings, args.train_set)
        if args.stage in ("eval", "all"):
            stage_eval(data, out, names, timings, args.groups, args.eval_set, args.vllm)
        if args.stage == "rescore" or args.smoke:
            stage_rescore(out, names)
    finally:  # merged into what is there now: another invocation may have written since this one began
        current = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
        timing_file.write_text(json.dumps({**current, **timings}, indent=1))
    if args.stage in ("report", "all"):
        stage_report(out, names, args.steps, timings, args.tag, results)


if __name__ == "__main__":
    main()
