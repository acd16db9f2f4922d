"""The one table of `eyas` commands: the pipeline's stages, in the order they run, then the tools.

Every command has a name, the module whose `main(argv)` runs it and a one-line help
(`eyas.cli` lists and dispatches them). A pipeline stage also says where its output lies, what
that output depends on and which files mark it finished (`eyas.stages` keeps its record from
these), and how SLURM runs it: its job templates in `slurm/` and the GPUs a job holds
(`slurm/submit.py`). `eyas.quickstart` runs the pipeline stages in table order. A tool
(quickstart, submit, launch, verify, plan) has no output of its own to check.

This module is data only (no stage is imported), so `eyas --help` and `eyas submit` read it for free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from eyas.config import Recipe

# The GPUs one SLURM job of a stage holds on GPU nodes: every GPU of each node, one, none, or a count.
Gpus = Literal["node", "one", "none"] | int


def _reads_nothing(recipe: Recipe) -> tuple[str, ...]:
    return ()


def _no_gpu(recipe: Recipe) -> Gpus:
    return "none"


@dataclass(frozen=True)
class Command:
    """One row of the table. `output` is None for a tool; the columns after it are the stages' own."""

    name: str
    module: str  # has `main(argv) -> int`
    help: str  # one line, for `eyas --help` and the command's own `--help`
    # Pipeline stages (eyas.stages): the output folder, the recipe sections (`data`) or single keys
    # (`draft.kind`) it depends on, the stages whose records it reads, and the files (relative to the
    # output) that exist once it has finished.
    output: Callable[[Recipe], Path] | None = None
    sections: tuple[str, ...] = ()
    upstream: Callable[[Recipe], tuple[str, ...]] = _reads_nothing
    done_files: tuple[str, ...] = ()
    # SLURM (slurm/submit.py): the `slurm/<job>.sbatch` templates of the stage, chained in this order,
    # the GPUs each of its jobs holds on GPU nodes, and the jobs among them that run on the host alone.
    slurm_jobs: tuple[str, ...] = ()
    slurm_gpus: Callable[[Recipe], Gpus] = _no_gpu
    slurm_host_jobs: tuple[str, ...] = ()

    @property
    def is_stage(self) -> bool:
        """A pipeline stage (prepare -> dump -> train -> eval -> export) rather than a tool."""
        return self.output is not None


def _prepare_gpus(recipe: Recipe) -> Gpus:
    """Prepare holds a GPU only when the target regenerates replies in the job itself (not through an endpoint)."""
    return "one" if recipe.data.regenerate and not recipe.data.regenerate_endpoint else "none"


def _dump_gpus(recipe: Recipe) -> Gpus:
    """A dump task runs the target on one GPU, or a vLLM engine over its tensor-parallel GPUs."""
    return recipe.dump.vllm_tensor_parallel_size if recipe.dump.backend == "vllm" else "one"


_TABLE = (
    Command("prepare", "eyas.data.prepare", "render chat data with the target's template and build loss masks",
            output=lambda r: r.run_dir / "prepared", sections=("target", "data", "run.seed"),
            done_files=("info.json", "train/dataset_info.json", "heldout/dataset_info.json"),
            slurm_jobs=("prepare",), slurm_gpus=_prepare_gpus),
    Command("dump", "eyas.data.dump", "run the frozen target and write hidden-state shards",
            output=lambda r: r.run_dir / "shards", sections=("target", "dump", "draft.kind"),
            upstream=lambda r: ("prepare",), done_files=("manifest.json", "heldout/manifest.json"),
            # an array of target tasks, then one task that writes the manifest and the draft vocabulary
            # from their shards without the target's weights (`eyas dump --finalize`): no GPU
            slurm_jobs=("dump", "dump_finalize"), slurm_gpus=_dump_gpus, slurm_host_jobs=("dump_finalize",)),
    Command("train", "eyas.train.loop", "train a draft head (eagle, eagle3, mtp) from shards or online",
            output=lambda r: r.run_dir / "checkpoints", sections=("target", "draft", "train"),
            upstream=lambda r: ("prepare",) if r.train.source == "online" else ("dump",),
            slurm_jobs=("train",), slurm_gpus=lambda r: "node"),
    Command("eval", "eyas.eval.cli", "speculative decoding with the draft: acceptance per depth, tau, speedup",
            output=lambda r: Path(r.eval.output) if r.eval.output else r.run_dir / "eval",
            sections=("target", "eval", "run.seed"),
            upstream=lambda r: ("prepare",) if r.eval.prompts == "heldout" else (),
            done_files=("report.json", "acceptance.png"), slurm_jobs=("eval",), slurm_gpus=lambda r: "one"),
    Command("export", "eyas.train.export", "write a checkpoint that SGLang or vLLM loads as it is",
            output=lambda r: r.run_dir / "export" / r.export.to, sections=("export", "target.path", "train.ttt_steps"),
            done_files=("eyas_export.json",), slurm_jobs=("export",)),
    Command("quickstart", "eyas.quickstart", "the whole pipeline on the embedded default target, on a CPU"),
    Command("submit", "eyas.slurm.submit", "render and submit SLURM jobs for a recipe's stages"),
    Command("launch", "eyas.launch", "torchrun or accelerate launch whose SIGTERM/SIGINT saves a checkpoint and exits 0"),
    Command("verify", "eyas.data.shard_verify", "check a run's shards in full: sizes, headers, checksums, offsets"),
    Command("plan", "eyas.plan", "GPU and host memory, shard bytes and optimizer steps per stage, before anything runs"),
)

# Every command, in the order `eyas --help` lists them.
COMMANDS: dict[str, Command] = {command.name: command for command in _TABLE}
# The pipeline stages, in the order they run.
STAGES: dict[str, Command] = {name: command for name, command in COMMANDS.items() if command.is_stage}
PIPELINE: tuple[str, ...] = tuple(STAGES)
