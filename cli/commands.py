"""The one table of `eyas` commands: the pipeline's stages (`eyas.pipeline`), in the order they run, then the tools.

Every command has a name, the module whose `main(argv)` runs it and a one-line help (`eyas.cli.main`
lists and dispatches them). A tool (quickstart, submit, launch, verify, plan) has no output of its own
to check; what a stage writes and depends on is its row in `eyas.pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.pipeline import STAGES


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # has `main(argv) -> int`
    help: str  # one line, for `eyas --help` and the command's own `--help`


TOOLS = (
    Command("quickstart", "eyas.cli.quickstart", "the whole pipeline on the embedded default target, on a CPU"),
    Command("submit", "eyas.slurm.submit", "render and submit SLURM jobs for a recipe's stages"),
    Command("launch", "eyas.cli.launch", "torchrun or accelerate launch whose SIGTERM/SIGINT saves a checkpoint and exits 0"),
    Command("verify", "eyas.data.shard_verify", "check a run's shards in full: sizes, headers, checksums, offsets"),
    Command("engine", "eyas.train.stream", "a vLLM engine that captures features for a recipe's streamed training"),
    Command("plan", "eyas.cli.plan", "GPU and host memory, shard bytes and optimizer steps per stage, before anything runs"),
)

# Every command, in the order `eyas --help` lists them: the stages, then the tools.
COMMANDS: dict[str, Command] = {
    **{name: Command(name, stage.module, stage.help) for name, stage in STAGES.items()},
    **{tool.name: tool for tool in TOOLS},
}
