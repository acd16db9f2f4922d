"""`eyas submit RECIPE --stage ...`: render the sbatch templates with a recipe's values and submit them.

    eyas submit recipes/llama3.1-8b-eagle3.yaml --stage all --nodes 2 --gpus-per-node 8 --partition gpu
    eyas submit recipes/quickstart.yaml --stage train --nodes 1 --gpus-per-node 0 --procs-per-node 2 --dry-run

Stages and the jobs each submits (`--stage all` chains them with `--dependency=afterok:`):

- `prepare`: one task; tokenises the conversations (`eyas prepare`).
- `dump`: a job array of `--dump-tasks` tasks (default: the nodes' GPUs over the GPUs a task holds:
  one, or `dump.vllm_tensor_parallel_size` with `dump.backend: vllm`), each the frozen
  target over a disjoint part of the samples (RANK/WORLD_SIZE), then a one-task `dump-finalize`
  job without GPUs (`eyas dump --finalize`, no target weights) that writes the manifest and the
  draft vocabulary. Needs `prepare` done first: submit
  `--stage prepare,dump` or `all`, or run `eyas prepare` beforehand.
- `train`: `--nodes` nodes, one launcher per node (`torchrun`, or `accelerate launch` with
  `--launcher accelerate`, each run by `eyas launch`), `--procs-per-node` processes each (default:
  the GPUs per node, 1 on CPU nodes); requeued after a USR1 checkpoint (time limit), appending its
  log; a scancel or a preemption (SIGTERM) checkpoints and exits 0.
- `eval`: one task; `eyas eval`.  `export`: one CPU task; `eyas export` in the recipe's format.

Everything is written under `<run_dir>/slurm/`: the resolved recipe the jobs read
(`recipe.yaml`, with absolute paths, so the jobs do not depend on the submit directory's
layout), the rendered scripts (`<stage>.sbatch`), `logs/`, and `jobs.json` with the job ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from eyas.config import save_resolved
from eyas.errors import EyasError
from eyas.pipeline import PIPELINE, STAGES, Gpus
from eyas.recipe_schema import Recipe
from eyas.stage_cli import stage_main, stage_parser

PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def template_text(name: str) -> str:
    """The text of `slurm/<name>.sbatch` (package data of `eyas.slurm`)."""
    path = resources.files("eyas.slurm") / f"{name}.sbatch"
    if not path.is_file():
        raise EyasError(f"SLURM template '{name}.sbatch' is missing from the eyas installation; reinstall eyas")
    return path.read_text()


def render(text: str, values: dict) -> str:
    """Fill `{{name}}` placeholders; a placeholder without a value is an error, never left in a script."""
    def fill(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            raise EyasError(f"SLURM template placeholder '{{{{{key}}}}}' has no value (eyas bug: please report it)")
        return str(values[key])

    return PLACEHOLDER.sub(fill, text)


def parse_stages(spec: str, recipe: Recipe) -> list[str]:
    """`all`, one stage, or a comma list; returned in pipeline order. `all` skips dump for online and streamed
    training."""
    if spec == "all":
        stages = list(PIPELINE)
        if recipe.train.source in ("online", "stream"):
            stages.remove("dump")
        return stages
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    for stage in wanted:
        if stage not in PIPELINE:
            raise EyasError(f"--stage '{stage}' is not a stage; choose from: {', '.join(PIPELINE)}, all (or a comma list)")
    return [s for s in PIPELINE if s in wanted]


def build_parser() -> argparse.ArgumentParser:
    parser = stage_parser("eyas submit", "render the SLURM templates for a recipe's stages and submit them",
                          force=False)
    parser.add_argument("--stage", default="all",
                        help=f"{', '.join(PIPELINE)}, a comma list, or all (chained with afterok)")
    parser.add_argument("--nodes", type=int, default=1, help="training nodes (one launcher per node)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU nodes, gloo backend)")
    parser.add_argument("--procs-per-node", type=int, default=0,
                        help="training processes per node (default: --gpus-per-node, or 1 on CPU nodes)")
    parser.add_argument("--dump-tasks", type=int, default=0,
                        help="dump array tasks, one GPU each (default: nodes x GPUs per node, or --nodes on CPU)")
    parser.add_argument("--cpus-per-task", type=int, default=0,
                        help="CPUs per task (default: 8 per GPU on GPU nodes, else 1 per process)")
    parser.add_argument("--partition", default="", help="SLURM partition")
    parser.add_argument("--account", default="", help="SLURM account")
    parser.add_argument("--time", default="", help="time limit per job, e.g. 24:00:00 (the partition's if empty)")
    parser.add_argument("--signal-seconds", type=int, default=300,
                        help="USR1 this many seconds before the time limit, so training checkpoints and requeues")
    parser.add_argument("--launcher", choices=("torchrun", "accelerate"), default="torchrun",
                        help="training launcher on each node")
    parser.add_argument("--accelerate-config", default="",
                        help="accelerate config file for --launcher accelerate (see recipes/accelerate/)")
    parser.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                        help="extra sbatch option for every job, e.g. --sbatch-arg=--qos=high (repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the scripts and print the sbatch commands, submit nothing")
    return parser


@dataclasses.dataclass
class Plan:
    """The resources of a submission, resolved from the command-line options."""

    nodes: int
    gpus_per_node: int
    procs_per_node: int
    dump_tasks: int
    cpus_per_task: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, recipe: Recipe) -> Plan:
        for name in ("nodes",):
            if getattr(args, name) < 1:
                raise EyasError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        for name in ("gpus_per_node", "procs_per_node", "dump_tasks", "cpus_per_task"):
            if getattr(args, name) < 0:
                raise EyasError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
        gpus = args.gpus_per_node
        procs = args.procs_per_node or max(gpus, 1)
        if gpus and procs != gpus:
            raise EyasError(f"--procs-per-node {procs} differs from --gpus-per-node {gpus}; "
                            "a GPU node runs one training process per GPU")
        per_task = gpu_count(STAGES["dump"].slurm_gpus(recipe), gpus) if gpus else 1
        if per_task > max(gpus, 1):
            raise EyasError(f"a dump task holds {per_task} GPUs (dump.vllm_tensor_parallel_size) but a node has "
                            f"--gpus-per-node {gpus}; lower dump.vllm_tensor_parallel_size to at most {gpus}")
        dump_tasks = args.dump_tasks or args.nodes * max(gpus, 1) // per_task
        return cls(args.nodes, gpus, procs, dump_tasks, args.cpus_per_task)

    def cpus_for(self, stage: str, recipe: Recipe) -> int:
        """CPUs per task: --cpus-per-task if given, else 8 per GPU the task holds, else one per process."""
        if self.cpus_per_task:
            return self.cpus_per_task
        if stage == "prepare":  # its tokenizer workers; 8 while it regenerates replies on GPU nodes
            return max(recipe.data.num_proc, 8 if self.gpus_per_node and recipe.data.regenerate else 1)
        gpus = STAGES[stage].slurm_gpus(recipe)
        if gpus == "node":
            return 8 * self.gpus_per_node if self.gpus_per_node else self.procs_per_node
        return 8 * gpu_count(gpus, self.gpus_per_node) if self.gpus_per_node else 1


def gpu_count(gpus: Gpus, per_node: int) -> int:
    """How many GPUs a job of a stage holds, on nodes of `per_node` GPUs."""
    named = {"node": per_node, "one": 1, "none": 0}
    return named[gpus] if isinstance(gpus, str) else int(gpus)


def _sbatch_lines(args: argparse.Namespace, gpus: str) -> str:
    """Optional `#SBATCH` lines: partition, account, time, GPUs for this job, extra options."""
    lines = []
    if args.partition:
        lines.append(f"#SBATCH --partition={args.partition}")
    if args.account:
        lines.append(f"#SBATCH --account={args.account}")
    if args.time:
        lines.append(f"#SBATCH --time={args.time}")
    if gpus:
        lines.append(f"#SBATCH {gpus}")
    for extra in args.sbatch_arg:
        if not extra.startswith("-") or "\n" in extra:
            raise EyasError(f"--sbatch-arg '{extra}' must be one sbatch option such as --qos=high")
        lines.append(f"#SBATCH {extra}")
    return "\n".join(lines)


def launch_args(args: argparse.Namespace, plan: Plan, recipe_path: Path) -> tuple[str, str]:
    """(launcher flag that takes the node rank, the rest of the launcher's arguments), shell-quoted."""
    py = "-m eyas.train"
    if args.launcher == "torchrun":
        launcher = "-m eyas.cli launch torchrun --node-rank"
        rest = ["--nnodes", str(plan.nodes), "--nproc-per-node", str(plan.procs_per_node),
                "--master-addr", "${MASTER_ADDR}", "--master-port", "${MASTER_PORT}"]
    else:
        launcher = "-m eyas.cli launch accelerate launch --machine_rank"
        rest = []
        if args.accelerate_config:
            config = Path(args.accelerate_config).resolve()
            if not config.is_file():
                raise EyasError(f"--accelerate-config '{args.accelerate_config}' does not exist; "
                                "see recipes/accelerate/")
            rest += ["--config_file", shlex.quote(str(config))]
        rest += ["--num_machines", str(plan.nodes), "--num_processes", str(plan.nodes * plan.procs_per_node),
                 "--main_process_ip", "${MASTER_ADDR}", "--main_process_port", "${MASTER_PORT}"]
        if plan.gpus_per_node == 0:
            rest.append("--cpu")
    # ${MASTER_ADDR}/${MASTER_PORT} stay unquoted on purpose: the batch shell expands them.
    rest += py.split() + [shlex.quote(str(recipe_path))]
    return launcher, " ".join(rest)


def job_values(recipe: Recipe, args: argparse.Namespace, plan: Plan, recipe_path: Path, slurm_dir: Path) -> dict:
    """Every placeholder value shared by the templates."""
    python = shlex.quote(sys.executable)
    recipe_arg = shlex.quote(str(recipe_path))
    launcher, rest = launch_args(args, plan, recipe_path)
    cpu_env = ("export CUDA_VISIBLE_DEVICES=\"\" ACCELERATE_USE_CPU=true  # CPU nodes: gloo backend"
               if plan.gpus_per_node == 0 else "")
    return {
        "job_name": re.sub(r"[^\w.-]", "_", recipe.run.name),
        "run_dir": shlex.quote(str(recipe.run_dir)),
        "log_dir": str(slurm_dir / "logs"),
        "workdir": shlex.quote(str(Path.cwd())),
        "python": python,
        "recipe": recipe_arg,
        "nodes": plan.nodes,
        "procs_per_node": plan.procs_per_node,
        "threads_per_proc": max(plan.cpus_for("train", recipe) // plan.procs_per_node, 1),
        "last_task": plan.dump_tasks - 1,
        "signal_seconds": args.signal_seconds,
        "launcher": launcher,
        "launch_args": rest,
        "device_env": cpu_env,
        "stream_engines": stream_engine_steps(recipe, plan, python, recipe_arg),
        "dump_command": f"{python} -m eyas.cli dump {recipe_arg}",
        "finalize_command": f"{python} -m eyas.cli dump --finalize {recipe_arg}",
    }


def stream_engine_steps(recipe: Recipe, plan: Plan, python: str, recipe_arg: str) -> str:
    """train.sbatch's lines for `train.source: stream` with `train.stream_engines` E: the E capture engines as job
    steps on the job's first node (`eyas engine`, with `dump.vllm_tensor_parallel_size` GPUs each on GPU nodes),
    and the overrides that point the trainers at them (a shared run folder carries the files). Other recipes:
    no engine, no override."""
    engines = recipe.train.stream_engines if recipe.train.source == "stream" else 0
    if not engines:
        return 'ENGINE_STEPS=()\nSTREAM_OVERRIDES=""'
    gpus = f" --gpus={recipe.dump.vllm_tensor_parallel_size}" if plan.gpus_per_node else ""
    port = recipe.train.stream_port
    return "\n".join([
        f"# train.source=stream: {engines} capture engine(s) as job steps on the first node, reached by the trainers",
        "ENGINE_STEPS=()",
        "ENDPOINTS=()",
        f"for ((E = 0; E < {engines}; E++)); do",
        f'    srun --overlap --nodes=1 --ntasks=1 --nodelist="${{HEAD_NODE}}"{gpus} {python} -m eyas.cli engine '
        f'{recipe_arg} --port $(({port} + E)) &',
        "    ENGINE_STEPS+=($!)",
        f'    ENDPOINTS+=("http://${{HEAD_NODE}}:$(({port} + E))/v1")',
        "done",
        'STREAM_OVERRIDES="train.stream_engines=0 train.stream_endpoints=[$(IFS=,; echo "${ENDPOINTS[*]}")]"',
        'echo "[eyas] train: capture engines at ${ENDPOINTS[*]}"',
    ])


def gpu_request(stage: str, job: str, plan: Plan, recipe: Recipe) -> str:
    """The GPU option for one job of a stage ('' on CPU nodes, for CPU-only stages and host-only jobs)."""
    if plan.gpus_per_node == 0 or job in STAGES[stage].slurm_host_jobs:
        return ""
    gpus = STAGES[stage].slurm_gpus(recipe)
    if gpus == "node":
        return f"--gpus-per-node={plan.gpus_per_node}"
    count = gpu_count(gpus, plan.gpus_per_node)
    return f"--gpus={count}" if count else ""


def template_names(stage: str) -> list[str]:
    """The stage's `slurm/<name>.sbatch` jobs, in the order they are chained."""
    return list(STAGES[stage].slurm_jobs)


def write_resolved_recipe(recipe: Recipe, slurm_dir: Path) -> Path:
    """The recipe the jobs read: every key resolved, the run directory made absolute."""
    return save_resolved(_absolute(recipe), slurm_dir, "recipe.yaml")


def _absolute(recipe: Recipe) -> Recipe:
    """The recipe with its run directory made absolute (jobs do not depend on the submit directory)."""
    return dataclasses.replace(recipe, run=dataclasses.replace(recipe.run,
                                                               output_dir=str(Path(recipe.run.output_dir).resolve())))


def sbatch(script: Path, dependency: str | None) -> str:
    """Submit one script; returns the job id (`sbatch --parsable` prints `id` or `id;cluster`)."""
    if shutil.which("sbatch") is None:
        raise EyasError("'sbatch' is not on PATH; run eyas submit on a SLURM login node, or use --dry-run")
    cmd = ["sbatch", "--parsable"] + ([f"--dependency=afterok:{dependency}"] if dependency else []) + [str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise EyasError(f"sbatch refused {script.name}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip().split(";")[0]


def submit(recipe: Recipe, args: argparse.Namespace) -> dict:
    """Render (and unless --dry-run, submit) every job of the requested stages; returns {job: id}."""
    plan = Plan.from_args(args, recipe)
    stages = parse_stages(args.stage, recipe)
    recipe = _absolute(recipe)
    slurm_dir = recipe.run_dir / "slurm"
    (slurm_dir / "logs").mkdir(parents=True, exist_ok=True)
    recipe_path = write_resolved_recipe(recipe, slurm_dir)
    values = job_values(recipe, args, plan, recipe_path, slurm_dir)
    jobs: dict[str, str] = {}
    previous: str | None = None
    for stage in stages:
        for name in template_names(stage):
            script_values = {**values, "sbatch_lines": _sbatch_lines(args, gpu_request(stage, name, plan, recipe)),
                             "cpus_per_task": plan.cpus_for(stage, recipe)}
            script = slurm_dir / f"{name}.sbatch"
            script.write_text(render(template_text(name), script_values))
            script.chmod(0o755)
            after = f" --dependency=afterok:{previous}" if previous else ""
            if args.dry_run:
                job_id = f"<{name}>"
                print(f"{name:14s} sbatch --parsable{after} {script}")
            else:
                job_id = sbatch(script, previous)
                print(f"{name:14s} job {job_id:>8s}  {script}")
            jobs[name] = job_id
            previous = job_id
    if not args.dry_run:
        record = {"submitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "jobs": jobs,
                  "logs": str(slurm_dir / "logs")}
        (slurm_dir / "jobs.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"logs: {slurm_dir / 'logs'}   watch: squeue -j {','.join(jobs.values())}")
    return jobs


def main(argv: list[str] | None = None) -> int:
    def body(recipe: Recipe, args: argparse.Namespace) -> int:
        submit(recipe, args)
        return 0

    return stage_main("submit", argv, body, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
