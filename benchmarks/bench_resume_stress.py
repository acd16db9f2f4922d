"""Resume under stress: SIGTERM a training run at varied points, resume it, and compare the final
checkpoint bitwise with an uninterrupted run's, N times.

Run: `nice -n 5 python benchmarks/bench_resume_stress.py` (100 drills, 5-20 s each on 2 lightly
loaded CPU cores, 25-70 s beside other jobs at a load average of 4; `--drills N`, `--seed S`, `--minutes M` to stop early with
what ran, `--launch exec` for a fresh `python -m eyas.train` per launch as
tests/test_train_distributed.py runs it; `--smoke`: 2 drills of 6 steps, seconds). Writes
benchmarks/results/bench_resume_stress.json; prints one line per drill and at the end
`BENCH resume_bitwise_equal <passed> of <N>`.

The drill is the one of `test_sigterm_checkpoints_exits_zero_and_resumes_exactly`: the tiny Llama
target of tests/fixtures.py, the 48-conversation workspace of tests/train_helpers.py, its recipe
(token_budget 400, ttt_steps 3, fp32, save_every 0, eval_every 0, 40 steps), one process, the test's
environment (OMP_NUM_THREADS=1, MKL_CBWR=AUTO,STRICT, ...). The uninterrupted reference runs once.
Each drill launches the same command, waits for metrics.jsonl to reach a chosen step, sleeps a
random fraction of a step and sends SIGTERM, so the signal lands mid-step, during the read-ahead,
in the logging, at the stop check, in the last steps' eval and save; a fifth of the drills run with
train.save_every=5 and aim the signal at the save of a periodic checkpoint. The run must exit 0
having saved; the same command (relaunched) must finish with exit 0; then every tensor of the final
draft (model.safetensors), of accelerate's model and optimizer state (state/, optimizer.bin read
with torch.load(weights_only=True)) and random states (python, numpy, torch), the scheduler and step
in trainer.json, and every logged loss must equal the reference's bitwise. A drill's line gives the
signal's point, the step saved, and for a difference the first differing tensor, its largest
absolute difference and the first step whose logged loss differs (which tells a first launch that
already diverged from a resume that went wrong). A drill whose first launch differed at a step it had
logged before the signal is no resume fault (the resumed launch rewrites only the rows after the
checkpoint): it is reported and counted (`BENCH launches_diverged_before_signal`, `launch_divergences`
in the JSON), its folder kept, and the pair run once more: a fresh reference launch (the reference
from then on; the JSON says whether it equals the first) and the same plan drilled against it, whose
result is the drill's. Either launch of a pair may be the one that did not reproduce, so drilling
again against the same reference would not decide.

Launches are cheap by default (`--launch fork`): a multiprocessing fork server imports eyas, torch
and transformers once and each launch is a fork of it running exactly what `python -m eyas.train`
runs (`eyas.stage_cli.run_stage("train", argv)`), which saves the ~6 s of imports per launch; the
reference always runs as a real `python -m eyas.train` (except under `--smoke`), so every
fork-launched drill is also compared across the two ways of starting.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The test's environment, set before torch is imported here or in the fork server (MKL reads
# MKL_CBWR once): strict reproducible MKL kernels, one OpenMP thread until the trainer sets its own.
TEST_ENV = {"OMP_NUM_THREADS": "1", "MKL_CBWR": "AUTO,STRICT", "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(TEST_ENV)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import pickle  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from machine import add_report_args, apply_smoke, bench_lines, environment, linked_run, output_path, tests_module, write_json  # noqa: E402

from eyas.train.metrics import first_loss_difference, logged_losses  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_resume_stress.json"
# tests/test_train_distributed.py's `workspace` recipe, with the SIGTERM test's overrides
RECIPE_TRAIN = {"token_budget": 400, "max_steps": 40, "ttt_steps": 3, "save_every": 0, "eval_every": 0, "log_every": 1,
                "warmup_steps": 1, "lr": 1e-3, "eval_batches": 2, "mixed_precision": "fp32"}
SAVE_EVERY = 5  # the periodic-save variant: a signal aimed at the save of step 5k
LAUNCH_TIMEOUT_S = 600


# ----------------------------------------------------------------------------- workspace


def build_workspace(root: Path, steps: int) -> Path:
    """The test's tiny target and workspace (prepared + dumped) and its recipe; returns the recipe path."""
    import yaml

    target = tests_module("fixtures").build_tiny_target(root / "tiny_llama", "llama")
    tests_module("train_helpers").make_workspace(root, target)
    recipe = {"target": {"path": str(target)}, "run": {"output_dir": str(root)}, "dump": {"draft_vocab_size": 128},
              "train": {**RECIPE_TRAIN, "max_steps": steps}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def new_run(root: Path, name: str) -> Path:
    """A fresh run folder on the workspace's shards and prepared data (tests/train_helpers.py's new_run)."""
    return linked_run(root / name, root / "base", ("shards", "prepared"))


# ----------------------------------------------------------------------------- launching


def _stage_in_child(argv: list[str], log: str) -> None:
    """A fork-server child: `python -m eyas.train ARGV` without the interpreter start and imports."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(REPO)
    from eyas.stage_cli import run_stage

    sys.exit(run_stage("train", argv))


class Job:
    """One launched training process: its pid, and its exit status once it ends."""

    def __init__(self, popen: subprocess.Popen | None = None, process: Any = None) -> None:
        self.popen, self.process = popen, process
        self.pid = popen.pid if popen is not None else process.pid

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen is not None else self.process.exitcode

    def wait(self, timeout: float) -> int | None:
        if self.popen is not None:
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(30)


class Launcher:
    """Starts `eyas.train` runs: forks of a server that has imported eyas (`fork`), or fresh interpreters (`exec`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.context = None
        if mode == "fork":
            self.context = multiprocessing.get_context("forkserver")
            self.context.set_forkserver_preload(["eyas.stage_cli", "eyas.train.loop"])

    def start(self, recipe: Path, overrides: list[str], log: Path, mode: str | None = None) -> Job:
        argv = [str(recipe), *overrides]
        if (mode or self.mode) == "exec":
            with open(log, "a") as out:
                return Job(popen=subprocess.Popen([sys.executable, "-m", "eyas.train", *argv], cwd=REPO, env=os.environ.copy(),
                                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        process = self.context.Process(target=_stage_in_child, args=(argv, str(log)))
        process.start()
        return Job(process=process)


def code_state() -> dict:
    """The commit and the files changed beside it: what the drills ran (others may edit the tree meanwhile;
    `--launch fork` imports eyas once, at the start)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--short", "--untracked-files=no").splitlines()}


def metrics_lines(run: Path) -> int:
    """Complete lines in the run's metrics.jsonl (0 before it exists)."""
    try:
        return (run / "logs" / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def run_to_end(launcher: Launcher, recipe: Path, overrides: list[str], run: Path, mode: str | None = None) -> tuple[int | None, float]:
    """Launch and wait; (exit status, seconds per step measured from the metrics file's growth)."""
    job = launcher.start(recipe, overrides, run / "launch.log", mode)
    first = last = None
    lines = 0
    while job.poll() is None:
        now_lines = metrics_lines(run)
        if now_lines > lines:
            first = first or (time.monotonic(), now_lines)
            last, lines = (time.monotonic(), now_lines), now_lines
        time.sleep(0.02)
    code = job.wait(LAUNCH_TIMEOUT_S)
    step_s = (last[0] - first[0]) / (last[1] - first[1]) if first and last and last[1] > first[1] else 0.0
    return code, step_s


# ----------------------------------------------------------------------------- comparing


def final_checkpoint(run: Path) -> Path | None:
    from eyas.train.checkpoint import latest_checkpoint

    return latest_checkpoint(run / "checkpoints")


def checkpoint_tensors(path: Path) -> dict[str, Any]:
    """Everything a resume restores: the draft, accelerate's model, optimizer and random states, scheduler and step."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {f"draft/{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors.update({f"state/{k}": v for k, v in load_file(str(path / "state" / "model.safetensors")).items()})
    optimizer = torch.load(path / "state" / "optimizer.bin", weights_only=True)
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            tensors[f"optimizer/{index}/{key}"] = value
    for g, group in enumerate(optimizer["param_groups"]):
        tensors.update({f"optimizer/group{g}/{k}": v for k, v in group.items() if k != "params"})
    # accelerate pickles the random states; this is the file the drill's own run just wrote
    for key, value in torch.load(path / "state" / "random_states_0.pkl", weights_only=False).items():
        tensors[f"rng/{key}"] = value if isinstance(value, torch.Tensor) else pickle.dumps(value)
    trainer = json.loads((path / "trainer.json").read_text())
    tensors.update({"trainer/step": trainer["step"], "trainer/tokens": trainer["tokens"],
                    "trainer/scheduler": json.dumps(trainer["scheduler"], sort_keys=True)})
    return tensors


def first_difference(got: dict[str, Any], want: dict[str, Any]) -> tuple[str, float] | None:
    """(name, largest absolute difference) of the first entry that is not bitwise equal, or None."""
    import torch

    for name in sorted(set(got) | set(want)):
        a, b = got.get(name), want.get(name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                return name, float("inf")
            if not torch.equal(a, b):
                return name, float((a.double() - b.double()).abs().max())
        elif a != b:
            return name, float("nan")
    return None


def train_rows(run: Path) -> int:
    """Complete train rows in a live run's metrics.jsonl (a line still being written is left out)."""
    try:
        lines = (run / "logs" / "metrics.jsonl").read_bytes().split(b"\n")[:-1]
    except FileNotFoundError:
        return 0
    return sum(json.loads(line).get("kind") == "train" for line in lines)


# ----------------------------------------------------------------------------- drills


@dataclass
class Reference:
    """An uninterrupted launch's final checkpoint tensors and logged losses, which every drill must equal."""

    name: str
    tensors: dict[str, Any]
    losses: dict[int, float]
    step_s: float


def run_reference(launcher: Launcher, recipe: Path, root: Path, name: str, smoke: bool) -> Reference:
    run = new_run(root, name)
    # a real `python -m eyas.train` (a smoke run saves the interpreter start: it tests the plumbing)
    code, step_s = run_to_end(launcher, recipe, [f"run.name={name}"], run, mode=None if smoke else "exec")
    if code != 0:
        raise SystemExit(f"the uninterrupted reference run {name} exited {code}:\n"
                         + (run / "launch.log").read_text(errors="replace")[-3000:])
    return Reference(name, checkpoint_tensors(final_checkpoint(run)), logged_losses(run), step_s)


def same_launch(a: Reference, b: Reference) -> bool:
    return first_difference(a.tensors, b.tensors) is None and first_loss_difference(a.losses, b.losses) is None


@dataclass
class Plan:
    """Where one drill's SIGTERM lands: after metrics.jsonl holds `after_line` lines, `delay_s` later."""

    kind: str
    after_line: int
    delay_s: float
    overrides: list[str] = field(default_factory=list)


def plan_drill(rng: random.Random, steps: int, step_s: float) -> Plan:
    """Mostly anywhere in the run (mid-step, read-ahead, logging); some at the start as the test does,
    some in the last steps (final eval and save), some at a periodic save (save_every=5)."""
    draw = rng.random()
    if draw < 0.1:
        return Plan("early", 1, rng.uniform(0, step_s))
    if draw < 0.2:
        return Plan("late", rng.randint(max(1, steps - 3), steps - 1), rng.uniform(0, 2 * step_s))
    if draw < 0.4 and steps > SAVE_EVERY:
        # the save of step 5k starts right after its metrics line: aim inside it (or at the stop check just before)
        line = SAVE_EVERY * rng.randint(1, (steps - 1) // SAVE_EVERY)
        return Plan("save", line, rng.uniform(0, 0.5 * step_s), [f"train.save_every={SAVE_EVERY}"])
    return Plan("step", rng.randint(1, steps - 1), rng.uniform(0, 1.5 * step_s))


@dataclass
class Drill:
    index: int
    kind: str
    after_line: int
    delay_s: float
    saved_step: int | None = None
    equal: bool = False
    difference: str = ""
    max_abs_diff: float | None = None
    first_loss_step: int | None = None
    rows_at_signal: int = 0  # train rows the first launch had logged when the signal was sent
    seconds: float = 0.0
    note: str = ""
    retried_after: str = ""  # a first attempt that diverged before its signal (`diverged_before_signal`)

    @property
    def diverged_before_signal(self) -> bool:
        """The first launch's own rows already differed before the SIGTERM: a launch that was not
        bitwise reproducible, which no resume caused (the resumed launch rewrites only later rows)."""
        return not self.equal and self.first_loss_step is not None and 0 < self.first_loss_step <= self.rows_at_signal


def wait_and_signal(job: Job, run: Path, plan: Plan) -> tuple[str, int]:
    """Send SIGTERM at the planned point; returns (a note when the run ended before it, the train rows
    logged when the signal was sent)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while metrics_lines(run) < plan.after_line:
        if job.poll() is not None:
            return f"ended (exit {job.poll()}) before line {plan.after_line}", 0
        if time.monotonic() > deadline:
            return "no metrics line in time", 0
        time.sleep(0.005)
    time.sleep(plan.delay_s)
    rows = train_rows(run)
    if job.poll() is not None:
        return "ended before the signal", rows
    os.kill(job.pid, signal.SIGTERM)
    return "", rows


def drill(index: int, plan: Plan, launcher: Launcher, recipe: Path, root: Path, steps: int, reference: Reference,
          again: bool = False) -> Drill:
    started = time.monotonic()
    result = Drill(index, plan.kind, plan.after_line, round(plan.delay_s, 3))
    name = f"drill_{index:03d}" + ("_again" if again else "")  # a drill done again keeps the first one's folder
    run = new_run(root, name)
    overrides = [f"run.name={name}", *plan.overrides]
    job = launcher.start(recipe, overrides, run / "launch.log")
    result.note, result.rows_at_signal = wait_and_signal(job, run, plan)
    code = job.wait(LAUNCH_TIMEOUT_S)
    if code is None:
        job.kill()
        return _failed(result, run, "the signalled run did not exit", started)
    if code != 0:
        return _failed(result, run, f"the signalled run exited {code}", started)
    saved = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    result.saved_step = saved[-1] if saved else None
    code, _ = run_to_end(launcher, recipe, overrides, run)
    if code != 0:
        return _failed(result, run, f"the resumed run exited {code}", started)
    final = final_checkpoint(run)
    if final is None or final.name != f"step_{steps:08d}":
        return _failed(result, run, f"no step_{steps:08d} checkpoint after the resume ({final})", started)
    differs = first_difference(checkpoint_tensors(final), reference.tensors)
    result.first_loss_step = first_loss_difference(logged_losses(run), reference.losses)
    result.equal = differs is None and result.first_loss_step is None
    if differs is not None:
        result.difference, result.max_abs_diff = differs
    elif result.first_loss_step is not None:
        result.difference = "logged loss"
    result.seconds = round(time.monotonic() - started, 1)
    if result.equal:
        shutil.rmtree(run, ignore_errors=True)  # a differing run is kept for inspection
    return result


def _failed(result: Drill, run: Path, why: str, started: float) -> Drill:
    log = (run / "launch.log").read_text(errors="replace")[-2000:] if (run / "launch.log").is_file() else ""
    result.difference = why
    result.seconds = round(time.monotonic() - started, 1)
    print(f"# drill {result.index}: {why}; log tail:\n{log}", flush=True)
    return result


def describe(d: Drill) -> str:
    where = f"{d.kind:5s} after line {d.after_line:2d} +{d.delay_s:.3f}s"
    saved = f"saved step {d.saved_step}" if d.saved_step is not None else "saved nothing"
    if d.equal:
        verdict = "equal"
    else:
        diff = f" (max abs diff {d.max_abs_diff:.3g})" if d.max_abs_diff is not None else ""
        loss = f", first differing loss at step {d.first_loss_step}" if d.first_loss_step is not None else ""
        verdict = f"DIFFERS: {d.difference}{diff}{loss}"
    note = f" [{d.note}]" if d.note else ""
    return f"drill {d.index:3d}: {where}, {saved}: {verdict}{note} ({d.seconds:.0f} s, load {os.getloadavg()[0]:.2f})"


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="seeds where the signals land")
    parser.add_argument("--steps", type=int, default=40, help="train.max_steps (the test's 40)")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop starting drills after this long (0: no limit)")
    parser.add_argument("--launch", choices=("fork", "exec"), default="fork",
                        help="fork: forks of a server that imported eyas once (cheap); exec: `python -m eyas.train` per launch")
    parser.add_argument("--workdir", help="where the workspace is built (default: a temporary folder, removed unless a drill failed)")
    add_report_args(parser, "bench_resume_stress.json", "seconds: 2 drills of 6 steps")
    args = parser.parse_args()
    apply_smoke(args, "bench_resume_stress", target=False, drills=2, steps=6)
    out = output_path(args.out, RESULTS, args.smoke)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-resume-stress-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    code = 1
    try:
        code = stress(args, root, out)
    finally:
        if args.workdir is None and code == 0:
            shutil.rmtree(root, ignore_errors=True)
        elif args.workdir is None:
            print(f"# kept {root} (the differing or failed runs, for inspection)")
    return code


def stress(args: argparse.Namespace, root: Path, out: Path) -> int:
    started = time.monotonic()
    tree = code_state()
    recipe = build_workspace(root, args.steps)
    launcher = Launcher(args.launch)
    reference = run_reference(launcher, recipe, root, "reference", args.smoke)
    step_s = reference.step_s
    print(f"# reference: {args.steps} steps, {step_s:.3f} s/step, {len(reference.tensors)} tensors and values compared "
          f"per drill; launch {args.launch}", flush=True)
    rng = random.Random(args.seed)
    drills: list[Drill] = []
    launch_divergences: list[dict] = []  # first attempts that diverged before their signal
    loads: list[list[float]] = []
    for index in range(args.drills):
        if args.minutes and time.monotonic() - started > 60 * args.minutes:
            print(f"# stopped after {len(drills)} drills: --minutes {args.minutes:g} reached", flush=True)
            break
        loads.append([round(x, 2) for x in os.getloadavg()])
        plan = plan_drill(rng, args.steps, step_s)
        result = drill(index, plan, launcher, recipe, root, args.steps, reference)
        if result.diverged_before_signal:
            # Not a resume fault (rows before the signal are the first launch's own), and either launch of the
            # pair may be the one that did not reproduce: run the pair again, a fresh reference and the same
            # drill, and let the second pair decide (a resume fault differs every time). The fresh reference
            # stays the reference for the drills after.
            first = describe(result)
            fresh = run_reference(launcher, recipe, root, f"reference_again_{index:03d}", args.smoke)
            equal = same_launch(fresh, reference)
            print(f"{first}\n# drill {index}: the first launch already differed at step {result.first_loss_step}, before its "
                  f"signal (it had logged {result.rows_at_signal} steps): a launch that was not bitwise reproducible, not a "
                  f"resume fault; a fresh reference launch {'equals' if equal else 'DIFFERS from'} the first one; "
                  "drilling the same plan again against it", flush=True)
            launch_divergences.append({**asdict(result), "fresh_reference_equal": equal})
            reference = fresh
            result = drill(index, plan, launcher, recipe, root, args.steps, reference, again=True)
            result.retried_after = first
        drills.append(result)
        print(describe(result), flush=True)
    passed = sum(d.equal for d in drills)
    record = {"passed": passed, "drills": len(drills), "requested": args.drills, "seed": args.seed, "steps": args.steps,
              "launch": args.launch, "step_s_reference": step_s, "seconds": round(time.monotonic() - started, 1),
              "load_average_per_drill": loads, "env": TEST_ENV, "smoke": args.smoke,
              **environment("accelerate", "transformers"), "code": tree,
              "launch_divergences": launch_divergences, "results": [asdict(d) for d in drills]}
    write_json(out, record, indent=1, newline=False)
    print(f"# {out}")
    bench_lines(f"resume_bitwise_equal {passed} of {len(drills)}",
                f"launches_diverged_before_signal {len(launch_divergences)} of {len(drills) + len(launch_divergences)}")
    return 0 if passed == len(drills) else 1


if __name__ == "__main__":
    sys.exit(main())
