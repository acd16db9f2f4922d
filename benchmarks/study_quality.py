"""The quality study: which training data and which draft give the highest acceptance on the real
SmolLM2-135M-Instruct target, trained and measured on this machine with the eyas CLI as a user runs it.

    python benchmarks/study_quality.py                        # every stage; each one is skipped when done
    python benchmarks/study_quality.py --stage train --only eagle3-ttt3 mtp3-chain
    python benchmarks/study_quality.py --stage report         # table + plot from the eval reports
    python benchmarks/study_quality.py --smoke                # seconds: one data variant, one draft, one suite

Every run starts from `benchmarks/study_base.yaml` plus the overrides below, so each variant
differs from the base in the settings its name says and nothing else. Data variants are prepared
and dumped once each; draft variants reuse a data variant's `prepared/` and `shards/` (symlinked
into their own run directory) and are trained with the same token budget, learning rate and
number of optimizer steps. Eval decodes the same prompts with every draft in one process
(interleaved with the target alone, see eyas.eval.runner), for each prompt set and temperature.
Writes benchmarks/results/study_quality.json, study_quality.md and study_quality.png, and a `BENCH`
line per suite, draft and shape.
`--smoke` runs every stage of a smaller plan (the `regen` data, the `eagle3-ttt3` draft, the `chat-t0`
suite) on tests/fixtures.py's tiny target, with the base recipe cut to seconds; everything, results
included, goes to a temp folder (or --out).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import machine  # benchmarks/machine.py

ROOT = machine.REPO
BASE = ROOT / "benchmarks" / "study_base.yaml"
RESULTS = machine.RESULTS

# data variant -> (data variant whose prepared/ it reuses or None, prepare overrides, dump overrides)
DATA = {
    "regen": (None, [], []),
    "raw": (None, ["data.regenerate=false"], []),
    "regen-bf16": ("regen", [], ["dump.encoding=bf16"]),       # the same samples, features stored in bf16
}
# data variant -> (data variant, fraction): the first part of that variant's prepared training rows
# (no new regeneration), its held-out split unchanged, dumped on its own
SUBSETS = {"regen-half": ("regen", 0.5)}
# data variant -> prepare overrides: prepared only, to be merged below (not dumped on its own)
PARTS = {"self": ["data.source=none", "data.self_prompts=1200"]}  # 1,200 conversations the target writes itself
# data variant -> the data variants whose prepared rows it joins (train and held-out splits alike)
MERGES = {"regen-self": ("regen", "self")}

# draft variant -> (data variant, train overrides)
DRAFTS = {
    "eagle3-ttt3": ("regen", []),
    # EAGLE-1 predicts over the target's full 49,152-token vocabulary (as served), which makes its
    # step about 4x dearer here: 48 steps are the same wall-clock budget as 141 eagle3 TTT-3 steps
    "eagle": ("regen", ["draft.kind=eagle", "train.max_steps=48", "train.eval_every=16", "train.save_every=16"]),
    "eagle3-ttt1": ("regen", ["train.ttt_steps=1"]),
    "eagle3-ttt7": ("regen", ["train.ttt_steps=7"]),
    "mtp3-chain": ("regen", ["draft.kind=mtp", "draft.num_steps=3", "draft.mtp_feed=chain"]),
    "mtp3-target": ("regen", ["draft.kind=mtp", "draft.num_steps=3", "draft.mtp_feed=target"]),
    "mtp5-chain": ("regen", ["draft.kind=mtp", "draft.num_steps=5", "draft.mtp_feed=chain", "train.ttt_steps=5"]),
    "mtp5-target": ("regen", ["draft.kind=mtp", "draft.num_steps=5", "draft.mtp_feed=target", "train.ttt_steps=5"]),
    # the human replies are short (14K loss tokens against 106K): the same 141 steps are 11 epochs
    "eagle3-ttt3-raw": ("raw", ["train.max_steps=141"]),
    # bf16 against 8-bit (fp8) shards, same samples and steps
    "eagle3-ttt3-bf16": ("regen-bf16", []),
    # more data against more epochs at the same compute: 6 epochs of half the data = the base's 3 of all;
    # and twice the compute spent on more epochs
    "eagle3-ttt3-half": ("regen-half", ["train.epochs=6"]),
    "eagle3-ttt3-6ep": ("regen", ["train.epochs=6"]),
    # the chat data plus 1,200 target-written conversations (instructions, code, advice), 3 epochs
    "eagle3-ttt3-self": ("regen-self", []),
    "mtp5-target-self": ("regen-self", ["draft.kind=mtp", "draft.num_steps=5", "draft.mtp_feed=target",
                                        "train.ttt_steps=5"]),
}

# eval suite -> (prompts, temperature, drafts compared); 8 prompts per suite (2 per category of
# instruct.jsonl) of 40 new tokens keep a suite of 8 drafts within about 7 minutes on 2 cores
EVAL_PROMPTS = 8
SUITE_PROMPTS = {"chat-t0-data": 16, "instruct-t0-data": 16}  # the data comparisons are closer: more prompts
SUITE_OVERRIDES = {"chat-t0-bf16": ["target.dtype=bfloat16"]}
WITH_QUICKSTART = {"chat-t0", "chat-t0-best"}  # suites where `eyas quickstart`'s draft is measured too
EVAL_TOKENS = 40
DRAFT_KINDS = ["eagle", "eagle3-ttt1", "eagle3-ttt3", "eagle3-ttt7", "mtp3-chain", "mtp3-target", "mtp5-chain",
               "mtp5-target"]
DATA_VARIANTS = ["eagle3-ttt3", "eagle3-ttt3-raw"]
# the later data comparisons, measured side by side with the base draft on twice the prompts
DATA_COMPARISONS = ["eagle3-ttt3", "eagle3-ttt3-bf16", "eagle3-ttt3-half", "eagle3-ttt3-6ep", "eagle3-ttt3-self",
                    "mtp5-target", "mtp5-target-self"]
# the drafts trained with target-written prompts against the same drafts without, on instructions
SELF_COMPARISONS = ["eagle3-ttt3", "eagle3-ttt3-self", "mtp5-target", "mtp5-target-self"]
SUITES = {
    "chat-t0": ("heldout", 0.0, DRAFT_KINDS + DATA_VARIANTS[1:]),
    "chat-t0-data": ("heldout", 0.0, DATA_COMPARISONS),
    "instruct-t0-data": (str(ROOT / "benchmarks" / "prompts" / "instruct.jsonl"), 0.0, SELF_COMPARISONS),
    # the target in bf16 (as served on GPUs): on this AMX CPU a bf16 forward over 13 tokens costs about
    # what one token does, so verification is nearly free; speedup against the same bf16 target alone
    "chat-t0-bf16": ("heldout", 0.0, ["eagle3-ttt3", "mtp5-target", "mtp3-target"]),
    # the best drafts of the widened data beside the quickstart's (run again after a quickstart change)
    "chat-t0-best": ("heldout", 0.0, ["eagle3-ttt3-self", "mtp5-target-self"]),
    "chat-t1": ("heldout", 1.0, DRAFT_KINDS),
    "instruct-t0": (str(ROOT / "benchmarks" / "prompts" / "instruct.jsonl"), 0.0, DRAFT_KINDS),
    "instruct-t1": (str(ROOT / "benchmarks" / "prompts" / "instruct.jsonl"), 1.0, DRAFT_KINDS),
}


def eyas(stage: str, name: str, out: Path, overrides: list[str], log: Path) -> float:
    """Run one `eyas <stage>` on the base recipe as run `name`; returns wall seconds."""
    overrides = [f"run.name={name}", f"run.output_dir={out}", *[o.format(out=out) for o in overrides]]
    return machine.eyas_stage(stage, BASE, overrides, log, "study")


def subset_prepared(source: Path, run: Path, fraction: float) -> None:
    """run/prepared = the first `fraction` of source/prepared's training rows and all of its held-out rows."""
    import shutil

    from datasets import load_from_disk

    from eyas.data.prepare import split_stats

    if (run / "prepared" / "info.json").is_file():
        return
    train = load_from_disk(str(source / "prepared" / "train"))
    part = train.select(range(int(len(train) * fraction)))
    part.save_to_disk(str(run / "prepared" / "train"))
    shutil.copytree(source / "prepared" / "heldout", run / "prepared" / "heldout", dirs_exist_ok=True)
    info = json.loads((source / "prepared" / "info.json").read_text())
    info["splits"]["train"] = split_stats(part) | {"subset_of": str(source)}
    (run / "prepared" / "info.json").write_text(json.dumps(info, indent=1))


def merge_prepared(sources: list[Path], run: Path) -> None:
    """run/prepared = the rows of every source's prepared splits, in order."""
    from datasets import concatenate_datasets, load_from_disk

    from eyas.data.prepare import split_stats

    if (run / "prepared" / "info.json").is_file():
        return
    info = json.loads((sources[0] / "prepared" / "info.json").read_text())
    info["merged_from"] = [str(s) for s in sources]
    info["self_prompts"] = sum(json.loads((s / "prepared" / "info.json").read_text()).get("self_prompts", 0)
                               for s in sources)
    for split in ("train", "heldout"):
        parts = [load_from_disk(str(s / "prepared" / split)) for s in sources]
        merged = concatenate_datasets([p for p in parts if len(p)])
        merged.save_to_disk(str(run / "prepared" / split))
        info["splits"][split] = split_stats(merged)
    (run / "prepared" / "info.json").write_text(json.dumps(info, indent=1))


def stage_data(out: Path, only: set[str], timings: dict) -> None:
    """The base data variants first, then those made from them (merges with their parts, subsets)."""
    for name, (reuse, prepare_over, dump_over) in DATA.items():
        if only and name not in only:
            continue
        run = out / name
        if reuse:
            machine.linked_run(run, out / reuse, ("prepared",), fresh=False)
        elif not (run / "prepared" / "info.json").is_file():
            timings[f"prepare:{name}"] = eyas("prepare", name, out, prepare_over, out / f"{name}.prepare.log")
        if not (run / "shards" / "heldout").is_dir():
            timings[f"dump:{name}"] = eyas("dump", name, out, dump_over, out / f"{name}.dump.log")
    for name, parts in MERGES.items():
        if only and name not in only:
            continue
        for part in parts:
            if part in PARTS and not (out / part / "prepared" / "info.json").is_file():
                timings[f"prepare:{part}"] = eyas("prepare", part, out, PARTS[part], out / f"{part}.prepare.log")
        merge_prepared([out / p for p in parts], out / name)
        if not (out / name / "shards" / "heldout").is_dir():
            timings[f"dump:{name}"] = eyas("dump", name, out, [], out / f"{name}.dump.log")
    for name, (source, fraction) in SUBSETS.items():
        if only and name not in only:
            continue
        subset_prepared(out / source, out / name, fraction)
        if not (out / name / "shards" / "heldout").is_dir():
            timings[f"dump:{name}"] = eyas("dump", name, out, [], out / f"{name}.dump.log")


def stage_train(out: Path, only: set[str], timings: dict) -> None:
    for name, (data, overrides) in DRAFTS.items():
        if only and name not in only:
            continue
        run = out / name
        machine.linked_run(run, out / data, fresh=False)
        if not (run / "checkpoints" / "best").is_dir():
            timings[f"train:{name}"] = eyas("train", name, out, overrides, out / f"{name}.train.log")


# 3-step mtp heads cannot draft 4 deep: they run the same shapes cut to depth 3
SHALLOW = {"mtp3-chain", "mtp3-target"}
SHALLOW_SHAPES = ["chain:3", "dynamic:depth=3,topk=4,nodes=12"]


def stage_eval(out: Path, only: set[str], timings: dict, quickstart: Path | None) -> None:
    """Eval every suite's drafts; a draft added to a suite later gets its own run (`deep-2`, ...),
    so the reports on disk are never redone."""
    for suite, (prompts, temperature, drafts) in SUITES.items():
        if only and suite not in only:
            continue
        groups = {"deep": [d for d in drafts if d not in SHALLOW], "shallow": [d for d in drafts if d in SHALLOW]}
        for group, names in groups.items():
            done = [json.loads(r.read_text()) for r in sorted((out / "eval" / suite).glob(f"{group}*/report.json"))]
            measured = {draft_of(c["draft"]) for report in done for c in report["configs"]}
            names = [n for n in names if n not in measured]
            if not names:
                continue
            folder = out / "eval" / suite / (group if not done else f"{group}-{len(done) + 1}")
            checkpoints = [str(out / d / "checkpoints" / "best") for d in names]
            if quickstart is not None and suite in WITH_QUICKSTART and group == "deep" and not done:
                checkpoints.append(str(quickstart / "checkpoints" / "best"))
            overrides = [f"eval.prompts={prompts}", f"eval.temperature={temperature}", f"eval.output={folder}",
                         f"eval.max_prompts={SUITE_PROMPTS.get(suite, EVAL_PROMPTS)}", f"eval.max_new_tokens={EVAL_TOKENS}",
                         "eval.drafts=" + json.dumps(checkpoints)]
            if group == "shallow":
                overrides.append("eval.shapes=" + json.dumps(SHALLOW_SHAPES))
            overrides += SUITE_OVERRIDES.get(suite, [])
            timings[f"eval:{suite}:{folder.name}"] = eyas("eval", "regen", out, overrides,
                                                          out / f"eval-{suite}-{folder.name}.log")


def _rows(suite: str, report: dict) -> list[dict]:
    base = (report.get("baseline") or {}).get("overall", {})
    rows = []
    for config in report["configs"]:
        o = config["overall"]
        rows.append({"suite": suite, "draft": draft_of(config["draft"]), "shape": config["shape"],
                     "tau": o["tau"], "alpha": o["alpha"], "speedup": o["speedup"],
                     "tokens_per_s": o["tokens_per_s"], "baseline_tokens_per_s": base.get("tokens_per_s"),
                     "greedy_match": o.get("greedy_match")})
    return rows


def draft_of(label: str) -> str:
    return label.split(":", 1)[0]


def stage_report(out: Path, timings: dict, results: Path = RESULTS) -> dict:
    """Collect the eval reports and training summaries into one JSON, a Markdown table and a plot."""
    suites = {}
    for suite in SUITES:
        for path in sorted((out / "eval" / suite).glob("*/report.json")):
            suites.setdefault(suite, []).append(json.loads(path.read_text()))
    rows = []
    for suite, reports in suites.items():
        for report in reports:
            rows += _rows(suite, report)
    training = {name: held_out_curve(out / name) for name in DRAFTS}
    base = BASE.relative_to(ROOT) if BASE.is_relative_to(ROOT) else BASE
    result = {"rows": rows, "training": training, "timings_s": timings, "base_recipe": str(base),
              "drafts": {k: {"data": v[0], "overrides": v[1]} for k, v in DRAFTS.items()},
              "data": {k: {"reuses": v[0], "prepare": v[1], "dump": v[2]} for k, v in DATA.items()},
              **machine.environment("transformers", "accelerate"), "date": machine.stamp()}
    machine.write_json(results / "study_quality.json", result, indent=1, newline=False)
    (results / "study_quality.md").write_text(markdown_table(rows))
    plot(rows, results / "study_quality.png")
    plot_training(training, results / "study_training.png")
    print(markdown_table(rows))
    for r in rows:
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{r['suite']}_{r['draft']}_{r['shape'].split(':')[0]}")
        machine.bench_lines(f"quality_tau_{name} {r['tau']:.3f} tokens/verify")
    print(f"study: wrote {results / 'study_quality.json'}, .md and .png")
    return result


def held_out_curve(run: Path) -> list[dict]:
    """The trainer's held-out evaluations (step, per-step accuracy, simulated acceptance) of one run."""
    path = run / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "sim_accept": r["sim_accept"],
             "accuracy": [r[k] for k in sorted(r) if k.startswith("acc_")]}
            for r in records if r.get("kind") == "eval"]


def plot_training(training: dict, path: Path) -> None:
    """Held-out step-0 accuracy and simulated acceptance against optimizer steps, per draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in training.items():
        if curve:
            steps = [c["step"] for c in curve]
            axes[0].plot(steps, [c["accuracy"][0] for c in curve], marker=".", label=name)
            axes[1].plot(steps, [c["sim_accept"] for c in curve], marker=".", label=name)
    axes[0].set(title="held-out accuracy of draft step 1", xlabel="optimizer step", ylabel="accuracy")
    axes[1].set(title="held-out simulated accepted drafts per verify", xlabel="optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    """Two tables: every suite x draft x shape with α per depth, then τ and speedup side by side."""
    lines = ["| suite | draft | shape | τ | α per depth | speedup |", "|---|---|---|---|---|---|"]
    for r in rows:
        alpha = " ".join(_fmt(a, ".2f") for a in r["alpha"])
        lines.append(f"| {r['suite']} | {r['draft']} | {r['shape']} | {_fmt(r['tau'], '.2f')} | {alpha} | "
                     f"{_fmt(r['speedup'], '.2f')}x |")
    cells = {(r["suite"], r["draft"], r["shape"].split(":")[0]): r for r in rows}  # chain / dynamic
    suites = [s for s in SUITES if any(k[0] == s for k in cells)]
    shapes = ["chain", "dynamic"]
    drafts = list(dict.fromkeys(r["draft"] for r in rows))
    head = [f"{suite} {shape}" for suite in suites for shape in shapes]
    lines += ["", "τ (speedup) per suite and shape:", "", "| draft | " + " | ".join(head) + " |",
              "|---|" + "---|" * len(head)]
    for draft in drafts:
        row = []
        for suite in suites:
            for shape in shapes:
                r = cells.get((suite, draft, shape))
                row.append(f"{_fmt(r['tau'], '.2f')} ({_fmt(r['speedup'], '.2f')}x)" if r else "")
        lines.append(f"| {draft} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """α per depth of every draft on held-out chat at T=0, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chat = [r for r in rows if r["suite"] == "chat-t0"]
    shapes = sorted({r["shape"] for r in chat})
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for r in (r for r in chat if r["shape"] == shape):
            depths = range(1, len(r["alpha"]) + 1)
            ax.plot(depths, [a if a is not None else float("nan") for a in r["alpha"]], marker="o",
                    label=f"{r['draft']} (τ {_fmt(r['tau'], '.2f')})")
        ax.set(title=f"held-out chat, T=0, {shape}", xlabel="draft depth", ylabel="α (acceptance at depth)",
               ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def use_smoke_plan(work: Path) -> None:
    """--smoke: the same stages over a smaller plan (one data variant, one draft, one suite), from the
    base recipe cut to seconds on the tiny target (the recipe file is written to `work`)."""
    global BASE, DATA, SUBSETS, PARTS, MERGES, DRAFTS, SUITES
    from eyas.config import load_recipe, save_resolved

    target = machine.tiny_target(work / "target")
    smoke = [f"target.path={target}", *machine.SMOKE_RUN, "data.regenerate=true", "data.regenerate_max_new_tokens=8",
             "data.regenerate_dtype=float32", "train.max_steps=2", "train.eval_every=2", "train.save_every=2"]
    BASE = save_resolved(load_recipe(BASE, smoke), work, "study_base_smoke.yaml")
    DATA, SUBSETS, PARTS, MERGES = {"regen": DATA["regen"]}, {}, {}, {}
    DRAFTS = {"eagle3-ttt3": DRAFTS["eagle3-ttt3"]}
    SUITES = {"chat-t0": ("heldout", 0.0, ["eagle3-ttt3"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="parent folder of the study's runs (default runs/study; --smoke: a temp folder, "
                        "which also takes the results)")
    parser.add_argument("--stage", choices=["data", "train", "eval", "report", "all"], default="all")
    parser.add_argument("--only", nargs="*", default=[], help="data/draft variants or eval suites to run")
    parser.add_argument("--quickstart", help="run directory of `eyas quickstart` (default runs/quickstart): its "
                        "draft joins the held-out chat T=0 comparison", default=str(ROOT / "runs" / "quickstart"))
    parser.add_argument("--smoke", action="store_true", help="seconds: one data variant, one draft, one suite, tiny target")
    args = parser.parse_args(argv)
    results = RESULTS
    if args.smoke:
        machine.apply_smoke(args, "study_quality", target=False)
        work = Path(args.out).resolve() if args.out else machine.smoke_dir("study_quality")
        use_smoke_plan(work)
        args.out, args.quickstart, results = str(work / "study"), "", work / "results"
    out = Path(args.out or ROOT / "runs" / "study").resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings_path = out / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    only = set(args.only)
    quickstart = Path(args.quickstart).resolve() if args.quickstart else None
    quickstart = quickstart if quickstart and (quickstart / "checkpoints" / "best").is_dir() else None
    for stage, body in (("data", stage_data), ("train", stage_train),
                        ("eval", lambda *a: stage_eval(*a, quickstart=quickstart))):
        if args.stage in (stage, "all"):
            body(out, only, timings)
            timings_path.write_text(json.dumps(timings, indent=1))
    if args.stage in ("report", "all"):
        stage_report(out, timings, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
