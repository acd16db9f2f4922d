"""The pipeline's stages, in the order they run: the one table of what each stage is.

Every stage has a name, the module whose `main(argv)` runs it and a one-line help, where its output
lies, what that output depends on and which files mark it finished (`eyas.stages` keeps its record
from these), and how SLURM runs it: its job templates in `slurm/` and the GPUs a job holds
(`slurm/submit.py`). The front door (`eyas.cli.commands`) adds the tools (quickstart, submit, launch,
verify, plan), which have no output of their own to check; the quickstart runs these stages in order.

This module is data only (no stage is imported), so `eyas --help` and `eyas submit` read it for free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from eyas.recipe_schema import Recipe

# The GPUs one SLURM job of a stage holds on GPU nodes: every GPU of each node, one, none, or a count.
Gpus = Literal["node", "one", "none"] | int


def _reads_nothing(recipe: Recipe) -> tuple[str, ...]:
    return ()


def _no_gpu(recipe: Recipe) -> Gpus:
    return "none"


@dataclass(frozen=True)
class Stage:
    """One row of the table."""

    name: str
    module: str  # has `main(argv) -> int`
    help: str  # one line, for `eyas --help` and the stage's own `--help`
    # The stage record (eyas.stages): the output folder, the recipe sections (`data`) or single keys
    # (`draft.kind`) it depends on, the stages whose records it reads, and the files (relative to the
    # output) that exist once it has finished.
    output: Callable[[Recipe], Path]
    sections: tuple[str, ...] = ()
    upstream: Callable[[Recipe], tuple[str, ...]] = _reads_nothing
    done_files: tuple[str, ...] = ()
    # SLURM (slurm/submit.py): the `slurm/<job>.sbatch` templates of the stage, chained in this order,
    # the GPUs each of its jobs holds on GPU nodes, and the jobs among them that run on the host alone.
    slurm_jobs: tuple[str, ...] = ()
    slurm_gpus: Callable[[Recipe], Gpus] = _no_gpu
    slurm_host_jobs: tuple[str, ...] = ()


def _prepare_gpus(recipe: Recipe) -> Gpus:
    """Prepare holds a GPU only when the target regenerates replies in the job itself (not through an endpoint)."""
    return "one" if recipe.data.regenerate and not recipe.data.regenerate_endpoint else "none"


def _dump_gpus(recipe: Recipe) -> Gpus:
    """A dump task runs the target on one GPU, or a vLLM engine over its tensor-parallel GPUs."""
    return recipe.dump.vllm_tensor_parallel_size if recipe.dump.backend == "vllm" else "one"


_TABLE = (
    Stage("prepare", "eyas.data.prepare", "render chat data with the target's template and build loss masks",
          output=lambda r: r.run_dir / "prepared", sections=("target", "data", "run.seed"),
          done_files=("info.json", "train/dataset_info.json", "heldout/dataset_info.json"),
          slurm_jobs=("prepare",), slurm_gpus=_prepare_gpus),
    Stage("dump", "eyas.data.dump", "run the frozen target and write hidden-state shards",
          output=lambda r: r.run_dir / "shards", sections=("target", "dump", "draft.kind"),
          upstream=lambda r: ("prepare",), done_files=("manifest.json", "heldout/manifest.json"),
          # an array of target tasks, then one task that writes the manifest and the draft vocabulary
          # from their shards without the target's weights (`eyas dump --finalize`): no GPU
          slurm_jobs=("dump", "dump_finalize"), slurm_gpus=_dump_gpus, slurm_host_jobs=("dump_finalize",)),
    Stage("train", "eyas.train.loop", "train a draft head (eagle, eagle3, mtp, peagle, dflash, dspark) from shards or online",
          output=lambda r: r.run_dir / "checkpoints", sections=("target", "draft", "train"),
          upstream=lambda r: ("prepare",) if r.train.source in ("online", "stream") else ("dump",),
          slurm_jobs=("train",), slurm_gpus=lambda r: "node"),
    Stage("eval", "eyas.eval.cli", "speculative decoding with the draft: acceptance per depth, tau, speedup",
          output=lambda r: Path(r.eval.output) if r.eval.output else r.run_dir / "eval",
          sections=("target", "eval", "run.seed"),
          upstream=lambda r: ("prepare",) if r.eval.prompts == "heldout" else (),
          done_files=("report.json", "acceptance.png"), slurm_jobs=("eval",), slurm_gpus=lambda r: "one"),
    Stage("export", "eyas.train.export", "write a checkpoint that SGLang or vLLM loads as it is",
          output=lambda r: r.run_dir / "export" / r.export.to, sections=("export", "target.path", "train.ttt_steps"),
          done_files=("eyas_export.json",), slurm_jobs=("export",)),
)

# The pipeline stages, in the order they run.
STAGES: dict[str, Stage] = {stage.name: stage for stage in _TABLE}
PIPELINE: tuple[str, ...] = tuple(STAGES)
