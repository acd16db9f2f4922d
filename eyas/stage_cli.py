"""The command-line plumbing every stage's `main(argv)` uses, below the front door.

Every stage's `main` is one call to `stage_main`: it parses the arguments (`stage_parser` unless
the stage has its own), loads the recipe with its overrides, writes it to `<run_dir>/recipe.yaml`
(the file to pass to any later stage of the run) and runs the stage body through `guarded`, which
turns an `EyasError` into one line on stderr and exit status 2 (a traceback only with `--debug`)
and a SIGTERM before the stage's own handler into one line and 143.

A command's one-line help is written once, in its table (a stage's in `eyas.pipeline`, a tool's in
the front door's `eyas.cli.commands`). `run_command`, which every `eyas <command>` and every stage
package's `python -m` entry goes through, hands it down with `hand_down_help` before it calls the
module's `main`, so no stage imports a table. A `main` called another way (its module run as a
script, a test) shows the first line of its module's docstring instead.

This module imports no stage and no front-door module (`tests/test_architecture.py`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eyas.config import load_recipe, save_resolved
from eyas.errors import EyasError
from eyas.pipeline import STAGES

# Each command's help, as the dispatcher handed it down from the command table.
_HELP: dict[str, str] = {}


def hand_down_help(name: str, text: str) -> None:
    """Record the command table's help for `name` (the dispatcher, before it calls the stage's `main`)."""
    _HELP[name] = text


def command_help(name: str, module_doc: str | None) -> str | None:
    """`name`'s one-line help: the table's when the dispatcher handed it down, else `module_doc`'s first line."""
    if name in _HELP:
        return _HELP[name]
    return module_doc.strip().splitlines()[0] if module_doc and module_doc.strip() else None


def run_command(name: str, module_name: str, help_line: str, argv: list[str]) -> int:
    """Import the command's module and run its `main(argv)`, its one-line help handed down from its table."""
    hand_down_help(name, help_line)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):  # the command's module itself is missing
            print(f"eyas: error: the '{name}' command is not built yet in this version of eyas", file=sys.stderr)
            return 3
        raise
    return int(module.main(argv) or 0)


def run_stage(name: str, argv: list[str]) -> int:
    """A pipeline stage's `main(argv)` (a stage package's `python -m` entry: `python -m eyas.train RECIPE`)."""
    stage = STAGES[name]
    return run_command(name, stage.module, stage.help, argv)


def stage_parser(prog: str, description: str | None, recipe_required: bool = True, force: bool = True,
                 epilog: str | None = None) -> argparse.ArgumentParser:
    """A parser with the arguments every recipe-driven stage takes (`force`: the stage skips current output)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    parser.add_argument("recipe", nargs=None if recipe_required else "?", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override recipe keys, e.g. train.lr=3e-4")
    if force:
        parser.add_argument("--force", action="store_true",
                            help="run the stage even if its output is current for these settings")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def run_recipe_path(recipe: Any) -> Path:
    """`<run_dir>/recipe.yaml`: the resolved recipe of the run's latest command, to pass to any stage."""
    return recipe.run_dir / "recipe.yaml"


def stage_main(name: str, argv: list[str] | None, body: Callable[[Any, argparse.Namespace], int | None], *,
               parser: argparse.ArgumentParser | None = None, default_recipe: Callable[[], Any] | None = None,
               extra_overrides: Callable[[argparse.Namespace], list[str]] | None = None,
               recipe: bool = True) -> int:
    """The `main()` of every stage: parse `argv`, load the recipe, run `body(recipe, args)` guarded.

    `parser`: the stage's own (default: `stage_parser` with the command's one-line help, `command_help`
    with the docstring of the module that defines `body`). `default_recipe`: the recipe file when none is
    given. `extra_overrides(args)`: flags turned into recipe overrides. `recipe=False`: the body gets `None`
    and reads `args` itself. A first positional that looks like `section.key=value` and is not a file is an
    override.
    """
    if parser is None:
        stage_doc = getattr(sys.modules.get(body.__module__), "__doc__", None)  # the module that defines `body`
        parser = stage_parser(f"eyas {name}", command_help(name, stage_doc))
    args = parser.parse_intermixed_args(argv)

    def run() -> int | None:
        if not recipe:
            return body(None, args)
        path, overrides = args.recipe, list(args.overrides)
        if path and "=" in path and not Path(path).is_file():
            path, overrides = None, [path] + overrides  # `eyas eval --target T eval.max_prompts=5`
        if path is None and default_recipe is not None:
            path = default_recipe()
        loaded = load_recipe(path, overrides + (extra_overrides(args) if extra_overrides else []))
        if int(os.environ.get("RANK", "0")) == 0:
            save_resolved(loaded, loaded.run_dir, run_recipe_path(loaded).name)
        return body(loaded, args)

    return guarded(run, getattr(args, "debug", False))


class Terminated(BaseException):
    """SIGTERM while no stage handler is installed (start-up: imports, loading the target, opening
    shards). A BaseException, so `except Exception` blocks let it pass."""


def _terminate(signum: int, _frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


def catch_sigterm() -> None:
    """Turn SIGTERM into `Terminated` while nobody else handles it (main thread only; the training
    loop installs its own handler, which checkpoints, and restores this one after)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


def stopped_by_sigterm(exc: Terminated) -> int:
    """Say that a SIGTERM stopped the command and what was kept; the exit status for it (143)."""
    print(f"eyas: stopped by {exc or 'SIGTERM'} before the stage finished; finished files are kept "
          "(every write is atomic), run the same command again to continue", file=sys.stderr)
    return 143


def guarded(body: Callable[[], int | None], debug: bool = False) -> int:
    """Run a stage body; user errors become one line and exit status 2, a SIGTERM one line and 143."""
    catch_sigterm()
    try:
        return int(body() or 0)
    except EyasError as exc:
        if debug:
            traceback.print_exc()
        print(f"eyas: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eyas: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:
        if debug:
            traceback.print_exc()
        return stopped_by_sigterm(exc)
