"""Multi-process training on CPU (slow): 2-process DDP and DeepSpeed ZeRO-3 equal 1 process on the
same global batch, a real SIGTERM checkpoints, exits 0 and resumes exactly, and a run resumes on
another number of processes (DDP 1 -> 2, ZeRO-2 2 -> 1) continuing the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from train_helpers import make_workspace, new_run

from eyas.train.metrics import first_loss_difference, logged_losses

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama_dir):
    ws = make_workspace(tmp_path_factory.mktemp("traindist"), tiny_llama_dir)
    recipe = {
        "target": {"path": str(tiny_llama_dir)},
        "run": {"output_dir": str(ws["root"])},
        "dump": {"draft_vocab_size": 128},
        "train": {"token_budget": 400, "max_steps": 4, "ttt_steps": 3, "save_every": 0, "eval_every": 0,
                  "log_every": 1, "warmup_steps": 1, "lr": 1e-3, "eval_batches": 2,
                  # fp32 whatever the CPU (auto picks bf16 where it is native): the process-count
                  # equalities below are properties of fp32 arithmetic
                  "mixed_precision": "fp32"},
    }
    ws["recipe"] = ws["root"] / "recipe.yaml"
    ws["recipe"].write_text(yaml.safe_dump(recipe))
    return ws


def _env() -> dict:
    # MKL_CBWR: MKL picks kernels by memory alignment unless told not to, which changes the last bits
    # of a matmul between two runs; exact-resume comparisons need the strict reproducible mode
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
               MKL_CBWR="AUTO,STRICT")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _log(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _final_weights(run: Path) -> dict:
    from eyas.train.checkpoint import latest_checkpoint

    return load_file(str(latest_checkpoint(run / "checkpoints") / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(workspace) -> Path:
    """The reference: 1 process, 2 micro-batches per step (the global batch of 2 processes x 1)."""
    one = new_run(workspace, "one_proc")
    _launch([sys.executable, "-m", "eyas.train", str(workspace["recipe"]), "run.name=one_proc", "train.grad_accum=2"])
    return one


def test_ddp_two_processes_equal_one_process(workspace, one_process):
    one, two = one_process, new_run(workspace, "two_procs")
    _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "eyas.train",
             str(workspace["recipe"]), "run.name=two_procs"])
    a, b = _log(one), _log(two)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same global batches
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    wa, wb = _final_weights(one), _final_weights(two)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(wa["fc.weight"], _initial_fc(workspace))  # it did train


def _initial_fc(workspace) -> torch.Tensor:
    """fc.weight as the head starts (same seed): proves the comparison is not between two untrained heads."""
    from accelerate.utils import set_seed

    from eyas.data.vocab import load_vocab
    from eyas.draft.features import default_layers
    from eyas.draft.registry import build_head
    from eyas.recipe_schema import DraftConfig
    from eyas.targets import load_target_config

    set_seed(0)
    config = load_target_config(str(workspace["target"]))
    d2t = load_vocab(workspace["root"] / "base" / "shards")[0]
    return build_head(DraftConfig(), config, default_layers(config.num_hidden_layers), d2t).fc.weight.detach()


# ZeRO-2 on 2 processes is covered by test_resume_on_another_number_of_processes[zero2-2-1] (its steps' losses and
# final weights equal the one-process reference's) and by tests/test_train_trust.py's DeepSpeed test (bf16, a
# DeepSpeed checkpoint written, resumed, its draft equal to DeepSpeed's fp32 masters); a test of its own that
# its loss fell over 8 steps took a launch (about 50 s on one core) until 2026-12-06.


def test_deepspeed_zero3_two_processes_equal_one_process(workspace, one_process):
    run = new_run(workspace, "zero3")
    _launch(["accelerate", "launch", "--config_file", str(REPO / "recipes/accelerate/deepspeed_zero3.yaml"),
             "--num_processes", "2", "-m", "eyas.train", str(workspace["recipe"]), "run.name=zero3"], timeout=400)
    assert [r["loss"] for r in _log(run)] == pytest.approx([r["loss"] for r in _log(one_process)], rel=1e-4)
    wa, wb = _final_weights(one_process), _final_weights(run)  # ZeRO-3 gathered the full draft for the files
    for name in wa:
        assert wa[name].shape == wb[name].shape, name
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5, msg=name)


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(workspace):
    """A real SIGTERM checkpoints, exits 0, and the resumed run ends bitwise equal to an uninterrupted one.

    A pair that differs is run once more and that pair decides: on some machines a fresh launch is,
    rarely, not bitwise reproducible even without a resume (seen in CI; cause unknown, docs/reliability.md),
    while a resume fault differs every time. The first difference is reported as a warning."""
    differs = _preempt_and_compare(workspace, "")
    if differs:
        warnings.warn(f"SIGTERM resume: the first pair differed ({differs}); running it once more", stacklevel=1)
        again = _preempt_and_compare(workspace, "_again")
        assert again is None, f"twice running: {differs}; then {again}"


def _preempt_and_compare(workspace, tag: str) -> str | None:
    """An uninterrupted run and a SIGTERM'd-then-resumed one; None when the final weights are bitwise equal,
    else what differs (the first differing tensor, its largest difference, the first differing logged loss)."""
    total = 40
    args = [sys.executable, "-m", "eyas.train", str(workspace["recipe"]), f"train.max_steps={total}",
            "train.save_every=0", "train.eval_every=0"]
    reference = new_run(workspace, "no_signal" + tag)
    _launch(args + [f"run.name=no_signal{tag}"])
    run = new_run(workspace, "preempted" + tag)
    proc = subprocess.Popen(args + [f"run.name=preempted{tag}"], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    saved = [int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*")]
    assert len(saved) == 1 and 2 <= saved[0] < total, saved
    assert "SIGTERM at step" in out + err
    _launch(args + [f"run.name=preempted{tag}"])
    assert [r["step"] for r in _log(run)] == list(range(1, total + 1))
    wa, wb = _final_weights(reference), _final_weights(run)
    name = next((name for name in wa if not torch.equal(wa[name], wb[name])), None)
    if name is None:
        return None
    step = first_loss_difference(logged_losses(run), logged_losses(reference))
    return (f"{name} differs by {float((wa[name] - wb[name]).abs().max()):.3g} at most; first differing logged loss: "
            f"step {step} (checkpoint at step {saved[0]})")


# ---- resuming on another number of processes ---------------------------------------------------

LAUNCHERS = {
    "ddp": lambda n: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n)],
    "zero2": lambda n: ["accelerate", "launch", "--config_file", str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"),
                        "--num_processes", str(n)],
}


# Each backend once and each direction once (the two other pairs add 70 s of CI for the same code paths:
# plan_resize and the data position are backend-independent, tests/test_data_shards.py covers 2<->1 and 4<->1;
# ZeRO-2 takes the direction a preempted job most often resumes in, onto fewer processes).
@pytest.mark.parametrize("backend, first, then", [("ddp", 1, 2), ("zero2", 2, 1)])
def test_resume_on_another_number_of_processes(workspace, one_process, backend, first, then):
    """Stopped after step 2 of 4 on `first` processes, resumed on `then`: train.grad_accum is recomputed so
    every step keeps the global batch of 2 micro-batches, each step takes the same samples (its token
    count equal to the uninterrupted run's), and loss and weights continue the uninterrupted run's
    within float summation order (1 process x 2 micro-batches, the `one_process` reference)."""
    name = f"resize_{backend}_{first}to{then}"
    run = new_run(workspace, name)
    accum = ["train.grad_accum=2"] if first == 1 else []
    _launch(LAUNCHERS[backend](first) + [str(REPO / "tests/train_until.py"), "2", str(workspace["recipe"]),
                                         f"run.name={name}", *accum], timeout=400)
    assert [r["step"] for r in _log(run)] == [1, 2]
    proc = _launch(LAUNCHERS[backend](then) + ["-m", "eyas.train", str(workspace["recipe"]), f"run.name={name}", *accum],
                   timeout=400)
    assert f"resuming {first} -> {then} process(es): train.grad_accum {2 // first} -> {2 // then}" in proc.stdout + proc.stderr
    a, b = _log(one_process), _log(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same samples in every step
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4)
    wa, wb = _final_weights(one_process), _final_weights(run)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-5, msg=key)
    assert not list((run / "checkpoints").glob(".universal-*"))  # the converted DeepSpeed state is gone


SLOW_PUBLISH = """
import os, signal, sys, time
import eyas.train.loop as loop

publish = loop.publish_dir

def slow_publish(partial, final):  # an artificial slow filesystem under the run directory
    # torchrun stops rank 0 with SIGTERM once rank 1 has failed; the trainer's handler would only note it
    # and torchrun would wait its 30 s grace before a SIGKILL: this stand-in for a stuck write dies at once
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    time.sleep(600)
    return publish(partial, final)

loop.publish_dir = slow_publish
sys.exit(loop.main(sys.argv[1:]))
"""


def test_slow_publish_on_rank_zero_stops_both_ranks_at_the_bound(workspace, tmp_path):
    """A checkpoint publish slower than train.dist_timeout_s stops the run with the step and the setting named,
    at the bound (rank 1 waits 8 s, not the publish's 10 minutes or a watchdog's 30); torchrun then stops rank 0."""
    run = new_run(workspace, "slow_publish")
    script = tmp_path / "slow_publish.py"
    script.write_text(SLOW_PUBLISH)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                           str(workspace["recipe"]), "run.name=slow_publish", "train.max_steps=1",
                           "train.dist_timeout_s=8"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("rank 1 stopped: the main process's checkpoint's signing and publishing did not finish within "
            "train.dist_timeout_s=8 s") in out, out[-4000:]
    assert took < 150, took  # it stopped at the bound, long before the publish would have ended
    assert not (run / "checkpoints" / "step_00000001").exists()  # nothing half-published
