"""The `eyas` command: one subcommand per row of the command table (`eyas.pipeline`).

Each stage lives in its own module with a `main(argv) -> int`; this file only dispatches,
so `eyas train RECIPE`, `python -m eyas.train RECIPE` and
`accelerate launch -m eyas.train RECIPE` run the same code. Every stage's `main` is one call
to `stage_main`: it parses the arguments (`stage_parser` unless the stage has its own), loads
the recipe with its overrides, writes it to `<run_dir>/recipe.yaml` (the file to pass to any
later stage of the run) and runs the stage body through `guarded`, which turns an `EyasError`
into one line on stderr and exit status 2 (a traceback only with `--debug`).
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
from eyas.pipeline import COMMANDS


def stage_parser(prog: str, description: str, recipe_required: bool = True, force: bool = True,
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

    `parser`: the stage's own (default: `stage_parser` with the stage's one-line help).
    `default_recipe`: the recipe file when none is given. `extra_overrides(args)`: flags turned
    into recipe overrides. `recipe=False`: the body gets `None` and reads `args` itself.
    A first positional that looks like `section.key=value` and is not a file is an override.
    """
    if parser is None:
        parser = stage_parser(f"eyas {name}", COMMANDS[name].help)
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


def _terminated(exc: Terminated) -> int:
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
        return _terminated(exc)


def quiet_thread_waits() -> None:
    """Let idle OpenMP threads sleep instead of spinning (before torch is imported; every `eyas` command).

    Decoding runs many tiny kernels; on a 2-core laptop that is also doing other work, spinning
    threads fight the busy cores and token-by-token decoding slowed 10-40x in our measurement
    (HF generate on the tiny test target: 1.4-2.6 tok/s with 2 spinning threads vs 40 tok/s with
    OMP_WAIT_POLICY=PASSIVE under the same load). Two stages sharing a machine suffer the same way:
    the target writing prompts beside a training run made under 6 tokens/s with spinning threads,
    about 50 with PASSIVE (and one thread). A user's own setting wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_stage(name: str, argv: list[str]) -> int:
    module_name = COMMANDS[name].module
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):  # the stage module itself is missing
            print(f"eyas: error: the '{name}' stage is not built yet in this version of eyas", file=sys.stderr)
            return 3
        raise
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    width = max(len(n) for n in COMMANDS)
    usage = "\n".join(f"  {n.ljust(width)}  {c.help}" for n, c in COMMANDS.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: eyas <command> [RECIPE] [section.key=value ...] [--debug]\n\ncommands:\n{usage}\n\n"
              "Run 'eyas <command> --help' for a command's options.")
        return 0 if argv else 1
    if argv[0] in ("-V", "--version"):
        from eyas import __version__  # the package's own __init__, read only for --version

        print(f"eyas {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; commands: {', '.join(COMMANDS)}"
        print(f"eyas: error: unknown command '{argv[0]}'{hint}", file=sys.stderr)
        return 2
    quiet_thread_waits()
    catch_sigterm()  # from here on, also while the stage module (torch, transformers) is imported
    try:
        return run_stage(argv[0], argv[1:])
    except Terminated as exc:
        return _terminated(exc)


if __name__ == "__main__":
    sys.exit(main())
