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
exported draft, and adds the wall time of each stage to `<run_dir>/quickstart.json` (the
latest run at the top, earlier runs under `history`).

Rerunning resumes: the quickstart is a loop over the stages, and each one decides through
`eyas.stages` (the same check `eyas prepare` etc. make) whether its output is current for the
recipe; a current stage is skipped, a changed setting reruns it and says which. The target is
loaded only when a stage that runs needs it. The dump redoes only missing shards, training
resumes from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from eyas import stages
from eyas.cli import quiet_thread_waits, run_recipe_path, stage_main
from eyas.config import Recipe, save_resolved
from eyas.errors import EyasError

RECIPE_NAME = "quickstart.yaml"
STAGES = ("target", "prepare", "dump", "train", "eval", "export")
SUMMARY = "quickstart.json"


def packaged_recipe() -> Path:
    """recipes/quickstart.yaml as installed with the package (`eyas.recipes`)."""
    path = resources.files("eyas.recipes") / RECIPE_NAME
    if not path.is_file():
        raise EyasError(f"the quickstart recipe '{RECIPE_NAME}' is missing from the eyas installation; reinstall eyas")
    return Path(str(path))


class Target:
    """The target model and tokenizer, loaded on first use: a rerun whose stages are current loads neither."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self._model: Any = None
        self._tokenizer: Any = None

    def model(self) -> Any:
        if self._model is None:
            # torch and transformers load only when a stage needs the target
            from eyas.targets import load_target

            self._model, self._tokenizer = load_target(self.recipe.target)
        return self._model

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            # torch and transformers load only when a stage needs the target
            from eyas.targets import load_tokenizer

            self._tokenizer = load_tokenizer(self.recipe.target)
        return self._tokenizer

    @property
    def loaded(self) -> Any:
        """The model if a stage already loaded it, else None."""
        return self._model

    def release(self) -> None:
        """Drop the model (eval loads the target its own way)."""
        self._model = None


class Progress:
    """Stage headers, timings, and the summary file with the history of earlier runs."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.timings: dict[str, dict] = {}
        self.started = time.perf_counter()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def stage(self, index: int, name: str, what: str, body: Callable[[Callable[[str], None]], tuple[bool, Any]]) -> Any:
        """Run one stage; `body(say)` returns (ran, result) and prints its verdict through `say`."""
        tag = f"[{index}/{len(STAGES)}] {name}"
        print(f"\n{tag}: {what}", flush=True)
        t0 = time.perf_counter()
        ran, result = body(lambda line: print(f"{tag}: {line}", flush=True))
        seconds = time.perf_counter() - t0
        self.timings[name] = {"seconds": round(seconds, 1), "skipped": not ran}
        if ran:
            print(f"{tag}: done in {seconds:.0f} s", flush=True)
        return result

    def write(self, extra: dict) -> Path:
        """Write this run's record; the records of earlier runs move, newest last, to `history`."""
        path = self.run_dir / SUMMARY
        history: list = []
        if path.is_file():
            try:
                previous = json.loads(path.read_text())
            except json.JSONDecodeError:
                previous = None  # a damaged summary is replaced, not a reason to fail a finished run
            if isinstance(previous, dict):
                history = list(previous.pop("history", None) or [])
                previous.pop("recipe", None)  # the timings are what the history is for
                history.append(previous)
        total = time.perf_counter() - self.started
        record = {"started": self.started_at, "stages": self.timings, "total_seconds": round(total, 1), **extra,
                  "history": history}
        # the summary is written once, at the end
        from eyas.io import atomic_write_json

        atomic_write_json(path, record)
        return path


def run(recipe: Recipe, export_to: str | None = None, force: bool = False) -> dict:
    """Run (or resume) every stage for `recipe`; returns the summary written to quickstart.json."""
    # torch and transformers load only when a stage needs the target
    from eyas.targets import cache_dir, resolve_target_path

    if export_to:
        recipe = dataclasses.replace(recipe, export=dataclasses.replace(recipe.export, to=export_to))
    run_dir = recipe.run_dir
    progress = Progress(run_dir)
    target = Target(recipe)

    def target_stage(say: Callable[[str], None]) -> tuple[bool, Any]:
        folder = resolve_target_path(recipe.target.path)
        say(f"files in {folder} (loaded when a stage needs them)")
        return True, folder

    note = ""
    if recipe.target.path.lower() == "smollm2-135m-instruct" and \
            not (cache_dir() / "targets" / "smollm2-135m-instruct" / "config.json").is_file():
        note = " (first use: converting its GGUF file to safetensors once)"
    progress.stage(1, "target", f"{recipe.target.path}{note}", target_stage)

    def prepare_stage(say: Callable[[str], None]) -> tuple[bool, Any]:
        # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
        from eyas.data.prepare import _report, prepare

        def body() -> None:
            # Regeneration loads the target itself (in data.regenerate_dtype); the tokenizer is shared.
            _report(prepare(recipe, tokenizer=target.tokenizer()), run_dir / "prepared")

        return stages.run("prepare", recipe, body, force=force, say=say)

    progress.stage(2, "prepare", f"{recipe.data.source} conversations -> {run_dir / 'prepared'}", prepare_stage)

    def dump_stage(say: Callable[[str], None]) -> tuple[bool, Any]:
        # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
        from eyas.data.dump import _report, dump

        def body() -> None:
            _report(dump(recipe, model=target.model(), tokenizer=target.tokenizer()), run_dir / "shards")

        return stages.run("dump", recipe, body, force=force, say=say)

    progress.stage(3, "dump", f"target features -> {run_dir / 'shards'} ({recipe.dump.encoding})", dump_stage)

    def train_stage(say: Callable[[str], None]) -> tuple[bool, Any]:
        # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
        from eyas.train.loop import train

        def body() -> dict:
            # Shards: the trainer reads only the target's embeddings and head from its files.
            model = target.model() if recipe.train.source == "online" else target.loaded
            result = train(recipe, target_model=model)
            print(f"eyas train: {result['outcome']} at step {result['step']}; best {result['best']}")
            return result

        return stages.run("train", recipe, body, force=force, say=say, files=lambda r: [r["checkpoint"]],
                          finished=lambda r: r["outcome"] == "done")

    progress.stage(4, "train", f"{recipe.draft.kind} head -> {run_dir / 'checkpoints'} "
                   "(resumes from the newest checkpoint)", train_stage)

    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.train.checkpoint import best_checkpoint

    checkpoint = Path(recipe.eval.checkpoint) if recipe.eval.checkpoint else best_checkpoint(run_dir)
    if checkpoint is None:
        raise EyasError(f"training left no checkpoint in '{run_dir / 'checkpoints'}'; rerun `eyas quickstart` "
                        "to resume it")
    target.release()  # eval loads the target its own way; free this copy

    def eval_stage(say: Callable[[str], None]) -> tuple[bool, Any]:
        from rich.console import Console

        # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
        from eyas.eval.cli import run as run_eval

        # The table is printed once, at the end of the run.
        return stages.run("eval", recipe, lambda: run_eval(recipe, console=Console(quiet=True)), force=force,
                          say=say, inputs=[checkpoint])

    progress.stage(5, "eval", f"speculative decoding with {checkpoint} on {recipe.eval.max_prompts} prompts",
                   eval_stage)
    report = json.loads((stages.STAGES["eval"].output(recipe) / "report.json").read_text())

    fmt = recipe.export.to
    out = stages.STAGES["export"].output(recipe)

    def export_stage(say: Callable[[str], None]) -> tuple[bool, Any]:
        # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
        from eyas.train.export import MARKER, export_draft

        def body() -> Path:
            path = export_draft(checkpoint, fmt, out, recipe.export.dtype,
                                recipe.export.num_speculative_tokens or recipe.train.ttt_steps, recipe.target.path)
            marker = json.loads((path / MARKER).read_text())
            print(f"eyas export: {marker['architecture']} in {path}")
            return path

        return stages.run("export", recipe, body, force=force, say=say, inputs=[checkpoint])

    progress.stage(6, "export", f"{fmt} format -> {out}", export_stage)
    serve = _serve_command(out)

    files = {"report": report["files"]["json"], "plot": report["files"]["plot"], "export": str(out),
             "checkpoint": str(checkpoint), "recipe": str(run_recipe_path(recipe))}
    summary_path = progress.write({"files": files, "recipe": recipe.to_dict()})
    _finish(report, files, progress, summary_path, serve)
    return json.loads(summary_path.read_text())


def _serve_command(export_dir: Path) -> str | None:
    """The serving command the exporter wrote into its marker file (None if it wrote none)."""
    marker = export_dir / "eyas_export.json"
    if not marker.is_file():
        return None
    return json.loads(marker.read_text()).get("serve")


def _finish(report: dict, files: dict, progress: Progress, summary_path: Path, serve: str | None) -> None:
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.eval.report import print_report

    print()
    print_report(report)
    times = ", ".join(f"{name} {t['seconds']:.0f} s" + (" (skipped)" if t["skipped"] else "")
                      for name, t in progress.timings.items())
    print(f"\nwall time per stage: {times}")
    print(f"acceptance plot:   {files['plot']}")
    print(f"eval report:       {files['report']}")
    print(f"exported draft:    {files['export']}")
    if serve:
        print(f"serve it with:     {serve}")
    print(f"draft checkpoint:  {files['checkpoint']}")
    print(f"stage timings:     {summary_path}")
    print(f"run recipe:        {files['recipe']} (give it to any stage, e.g. eyas eval {files['recipe']})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas quickstart",
                                     description="the whole pipeline (prepare, dump, train, eval, export) on the "
                                                 "embedded default target, on a CPU")
    parser.add_argument("recipe", nargs="?", default=None,
                        help=f"recipe YAML (default: the packaged {RECIPE_NAME})")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe keys")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first instead of resuming")
    parser.add_argument("--force", action="store_true", help="run every stage even if its output is current")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_thread_waits()  # `python -m eyas.quickstart` does not pass through `eyas.cli.main`

    def body(recipe: Recipe, args: argparse.Namespace) -> int:
        if args.fresh and recipe.run_dir.exists():
            print(f"eyas quickstart: --fresh: removing {recipe.run_dir}")
            shutil.rmtree(recipe.run_dir)
            save_resolved(recipe, recipe.run_dir, run_recipe_path(recipe).name)
        run(recipe, force=args.force)
        return 0

    return stage_main("quickstart", argv, body, parser=build_parser(), default_recipe=packaged_recipe)


if __name__ == "__main__":
    sys.exit(main())
