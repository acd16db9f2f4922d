"""The `eyas` command: one subcommand per row of the command table (`eyas.cli.commands`).

Each stage lives in its own module with a `main(argv) -> int`; this file only dispatches,
so `eyas train RECIPE`, `python -m eyas.train RECIPE` and
`accelerate launch -m eyas.train RECIPE` run the same code. What every stage's `main` shares
(`stage_main`, `stage_parser`, `guarded`, `run_command`) lives below the front door, in `eyas.stage_cli`;
the dispatcher hands each command's one-line help down to it from the table.
"""

from __future__ import annotations

import os
import sys

from eyas.cli.commands import COMMANDS
from eyas.stage_cli import Terminated, catch_sigterm, run_command, stopped_by_sigterm


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
        command = COMMANDS[argv[0]]
        return run_command(command.name, command.module, command.help, argv[1:])
    except Terminated as exc:
        return stopped_by_sigterm(exc)


if __name__ == "__main__":
    sys.exit(main())
