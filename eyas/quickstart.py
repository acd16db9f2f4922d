"""`eyas quickstart`: the whole pipeline on the embedded default, on a CPU.

    eyas quickstart                       # recipes/quickstart.yaml (shipped as eyas.recipes)
    eyas quickstart my.yaml train.lr=5e-4 # any recipe, with overrides
    eyas quickstart --fresh               # start over instead of resuming

Stages, in order, each in this process through its library function: the target (the real
SmolLM2-135M-Instruct, converted from its GGUF file once and cached), prepare (chitchat
conversations rendered with the target's chat template, loss on assistant tokens), dump
(hidden-state shards), train (an EAGLE-3 head), eval (speculative decoding: α per depth, τ,
speedup over the target alone) and export (SGLang format). Every stage shows its own progress
bar; the run ends with the acceptance table and the paths of the plot, the report and the
exported draft, and writes the wall time of each stage to `<run_dir>/quickstart.json`.

Rerunning resumes: a stage whose output exists for the same settings (compared through the
resolved recipe it saved next to its output) is skipped; the dump redoes only missing shards,
training resumes from its newest checkpoint (and returns at once when it is complete), eval
is skipped when its report is newer than the draft it measured, export rewrites its folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from eyas.errors import EyasError

RECIPE_NAME = "quickstart.yaml"
STAGES = ("target", "prepare", "dump", "train", "eval", "export")


def packaged_recipe() -> Path:
    """recipes/quickstart.yaml as installed with the package (`eyas.recipes`)."""
    path = resources.files("eyas.recipes") / RECIPE_NAME
    if not path.is_file():
        raise EyasError(f"the quickstart recipe '{RECIPE_NAME}' is missing from the eyas installation; reinstall eyas")
    return Path(str(path))


def _saved_sections(path: Path, sections: tuple[str, ...]) -> dict | None:
    """The given sections of a resolved recipe saved by a stage (None if there is none)."""
    if not path.is_file():
        return None
    saved = yaml.safe_load(path.read_text()) or {}
    return {s: saved.get(s) for s in sections}


def _same_settings(recipe: Any, saved_recipe: Path, sections: tuple[str, ...]) -> bool:
    """Whether a stage's saved resolved recipe agrees with this run on the sections it depends on."""
    saved = _saved_sections(saved_recipe, sections)
    if saved is None:
        return False
    current = recipe.to_dict()
    for dotted in sections:
        if saved.get(dotted) != current.get(dotted):
            return False
    return True


# Sections each stage's output depends on (a change there means the stage runs again).
PREPARE_DEPENDS = ("target", "data")
DUMP_DEPENDS = ("target", "data", "dump")


def prepare_done(recipe: Any) -> bool:
    out = recipe.run_dir / "prepared"
    return (out / "info.json").is_file() and _same_settings(recipe, out / "recipe.yaml", PREPARE_DEPENDS) \
        and _same_seed(recipe, out / "recipe.yaml")


def dump_done(recipe: Any) -> bool:
    out = recipe.run_dir / "shards"
    if not ((out / "manifest.json").is_file() and (out / "heldout" / "manifest.json").is_file()):
        return False
    if not _same_settings(recipe, out / "recipe.yaml", DUMP_DEPENDS) or not _same_seed(recipe, out / "recipe.yaml"):
        return False
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    return saved["draft"]["kind"] == recipe.draft.kind


def _same_seed(recipe: Any, saved_recipe: Path) -> bool:
    saved = yaml.safe_load(saved_recipe.read_text()) or {}
    return (saved.get("run") or {}).get("seed") == recipe.run.seed


def eval_done(recipe: Any, checkpoint: Path | None) -> bool:
    """The report exists, measured this checkpoint with these eval settings, and is newer than it."""
    report_path = recipe.run_dir / "eval" / "report.json"
    if checkpoint is None or not report_path.is_file():
        return False
    report = json.loads(report_path.read_text())
    if report.get("settings", {}).get("drafts") != [str(checkpoint)]:
        return False
    if (report.get("recipe") or {}).get("eval") != recipe.to_dict()["eval"]:
        return False
    weights = checkpoint / "model.safetensors"
    return weights.is_file() and report_path.stat().st_mtime > weights.stat().st_mtime


class Progress:
    """Stage headers, timings, and the summary file."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.timings: dict[str, dict] = {}
        self.started = time.perf_counter()

    def stage(self, index: int, name: str, what: str, body: Callable[[], Any], skip: str | None = None) -> Any:
        print(f"\n[{index}/{len(STAGES)}] {name}: {what}", flush=True)
        if skip:
            print(f"[{index}/{len(STAGES)}] {name}: skipped ({skip})", flush=True)
            self.timings[name] = {"seconds": 0.0, "skipped": True}
            return None
        t0 = time.perf_counter()
        result = body()
        seconds = time.perf_counter() - t0
        self.timings[name] = {"seconds": round(seconds, 1), "skipped": False}
        print(f"[{index}/{len(STAGES)}] {name}: done in {seconds:.0f} s", flush=True)
        return result

    def write(self, extra: dict) -> Path:
        total = time.perf_counter() - self.started
        record = {"stages": self.timings, "total_seconds": round(total, 1), **extra}
        path = self.run_dir / "quickstart.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        return path


def run(recipe: Any, export_to: str | None = None) -> dict:
    """Run (or resume) every stage for `recipe`; returns the summary written to quickstart.json."""
    from eyas.targets import cache_dir, load_target, resolve_target_path

    run_dir = recipe.run_dir
    progress = Progress(run_dir)
    state: dict[str, Any] = {}

    def target_stage():
        folder = resolve_target_path(recipe.target.path)
        state["model"], state["tokenizer"] = load_target(recipe.target)
        return folder

    alias_note = ""
    if recipe.target.path.lower() == "smollm2-135m-instruct" and \
            not (cache_dir() / "targets" / "smollm2-135m-instruct" / "config.json").is_file():
        alias_note = " (first use: de-quantising the GGUF file once, about 30 s)"
    folder = progress.stage(1, "target", f"load {recipe.target.path}{alias_note}", target_stage)
    print(f"      target files: {folder}")

    def prepare_stage():
        from eyas.data.prepare import _report, prepare

        info = prepare(recipe, tokenizer=state["tokenizer"])
        _report(info, run_dir / "prepared")

    progress.stage(2, "prepare", f"{recipe.data.source} conversations -> {run_dir / 'prepared'}", prepare_stage,
                   skip="prepared data with these settings exists" if prepare_done(recipe) else None)

    def dump_stage():
        from eyas.data.dump import _report, dump

        _report(dump(recipe, model=state["model"], tokenizer=state["tokenizer"]), run_dir / "shards")

    progress.stage(3, "dump", f"target features -> {run_dir / 'shards'} ({recipe.dump.encoding})", dump_stage,
                   skip="complete shards with these settings exist" if dump_done(recipe) else None)

    def train_stage():
        from eyas.train.loop import train

        result = train(recipe, target_model=state["model"])
        print(f"eyas train: {result['outcome']} at step {result['step']}; best {result['best']}")
        return result

    progress.stage(4, "train", f"{recipe.draft.kind} head -> {run_dir / 'checkpoints'} "
                   "(resumes from the newest checkpoint)", train_stage)

    from eyas.train.checkpoint import best_checkpoint

    checkpoint = Path(recipe.eval.checkpoint) if recipe.eval.checkpoint else best_checkpoint(run_dir)
    state.pop("model", None)  # eval loads the target its own way; free this copy

    def eval_stage():
        from eyas.eval.cli import run as run_eval

        return run_eval(recipe)

    progress.stage(5, "eval", f"speculative decoding with {checkpoint} on {recipe.eval.max_prompts} prompts",
                   eval_stage, skip="the report is newer than the draft it measured" if eval_done(recipe, checkpoint) else None)
    report = json.loads((run_dir / "eval" / "report.json").read_text())

    fmt = export_to or recipe.export.to
    out = run_dir / "export" / fmt

    def export_stage():
        from eyas.train.export import MARKER, export_draft

        path = export_draft(checkpoint, fmt, out, recipe.export.dtype,
                            recipe.export.num_speculative_tokens or recipe.train.ttt_steps, recipe.target.path)
        print(f"eyas export: {json.loads((path / MARKER).read_text())['architecture']} in {path}")
        return path

    progress.stage(6, "export", f"{fmt} format -> {out}", export_stage)

    files = {"report": report["files"]["json"], "plot": report["files"]["plot"], "export": str(out),
             "checkpoint": str(checkpoint)}
    summary_path = progress.write({"files": files, "recipe": recipe.to_dict()})
    _finish(report, files, progress, summary_path)
    return json.loads(summary_path.read_text())


def _finish(report: dict, files: dict, progress: Progress, summary_path: Path) -> None:
    from eyas.eval.report import print_report

    print()
    print_report(report)
    times = ", ".join(f"{name} {t['seconds']:.0f} s" + (" (skipped)" if t["skipped"] else "")
                      for name, t in progress.timings.items())
    print(f"\nwall time per stage: {times}")
    print(f"acceptance plot:   {files['plot']}")
    print(f"eval report:       {files['report']}")
    print(f"exported draft:    {files['export']}")
    print(f"draft checkpoint:  {files['checkpoint']}")
    print(f"stage timings:     {summary_path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas quickstart",
                                     description="the whole pipeline (prepare, dump, train, eval, export) on the "
                                                 "embedded default target, on a CPU")
    parser.add_argument("recipe", nargs="?", default=None,
                        help=f"recipe YAML (default: the packaged {RECIPE_NAME})")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe keys")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first instead of resuming")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    from eyas.cli import guarded, quiet_thread_waits

    quiet_thread_waits()  # `python -m eyas.quickstart` does not pass through `eyas.cli.main`
    from eyas.config import load_recipe

    args = build_parser().parse_intermixed_args(argv)
    if args.recipe and "=" in args.recipe and not Path(args.recipe).is_file():
        args.overrides.insert(0, args.recipe)  # `eyas quickstart train.lr=5e-4`
        args.recipe = None

    def body() -> int:
        recipe = load_recipe(args.recipe or packaged_recipe(), args.overrides)
        if args.fresh and recipe.run_dir.exists():
            print(f"eyas quickstart: --fresh: removing {recipe.run_dir}")
            shutil.rmtree(recipe.run_dir)
        run(recipe)
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
