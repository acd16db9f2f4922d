"""The `eyas` command: one subcommand per stage.

Each stage lives in its own module with a `main(argv) -> int`; this file only dispatches,
so `eyas train RECIPE`, `python -m eyas.train RECIPE` and
`accelerate launch -m eyas.train RECIPE` run the same code. Stage modules build their
argument parser with `stage_parser` and run their body through `guarded`, which turns an
`EyasError` into one line on stderr and exit status 2 (a traceback only with `--debug`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Callable

from eyas.errors import EyasError

# subcommand -> (module with main(argv), one-line help)
STAGES = {
    "prepare": ("eyas.data.prepare", "render chat data with the target's template and build loss masks"),
    "dump": ("eyas.data.dump", "run the frozen target and write hidden-state shards"),
    "train": ("eyas.train.loop", "train a draft head (eagle, eagle3, mtp) from shards or online"),
    "eval": ("eyas.eval.cli", "speculative decoding with the draft: acceptance per depth, tau, speedup"),
    "export": ("eyas.train.export", "write a checkpoint that SGLang or vLLM loads as it is"),
    "quickstart": ("eyas.quickstart", "the whole pipeline on the embedded default target, on a CPU"),
    "submit": ("eyas.slurm.submit", "render and submit SLURM jobs for a recipe's stages"),
}


def stage_parser(prog: str, description: str, recipe_required: bool = True) -> argparse.ArgumentParser:
    """A parser with the arguments every recipe-driven stage takes."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("recipe", nargs=None if recipe_required else "?", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe keys, e.g. train.lr=3e-4")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def guarded(body: Callable[[], int | None], debug: bool = False) -> int:
    """Run a stage body; user errors become one line and exit status 2."""
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
    module_name, _ = STAGES[name]
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
    width = max(len(n) for n in STAGES)
    usage = "\n".join(f"  {n.ljust(width)}  {h}" for n, (_, h) in STAGES.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: eyas <command> [RECIPE] [section.key=value ...] [--debug]\n\ncommands:\n{usage}\n\n"
              "Run 'eyas <command> --help' for a command's options.")
        return 0 if argv else 1
    if argv[0] in ("-V", "--version"):
        from eyas import __version__

        print(f"eyas {__version__}")
        return 0
    if argv[0] not in STAGES:
        import difflib

        close = difflib.get_close_matches(argv[0], list(STAGES), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; commands: {', '.join(STAGES)}"
        print(f"eyas: error: unknown command '{argv[0]}'{hint}", file=sys.stderr)
        return 2
    quiet_thread_waits()
    return run_stage(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
