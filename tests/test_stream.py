"""`train.source: stream` against real vLLM engines (serving tier): features equal to the vLLM dump's, a run equal to
the run from that dump's shards, and the faults: an engine killed mid-run, the trainer killed and resumed, an engine
that stalls, an engine of other layers.

One tiny Llama target (8 layers, hidden 128) and 40 chitchat conversations; a vLLM dump of them ('dump'), and two
capture engines started once for the module as `eyas engine` starts them (`EngineSpec.server`), which the runs
reach through train.stream_endpoints. The equality test's run starts its own engine (train.stream_engines 1), as
`eyas train` does on one node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from fixtures import build_tiny_target, write_chat_rows
from safetensors.torch import load_file

from eyas.errors import EyasError
from eyas.vllm_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serving, pytest.mark.timeout(1800)]

# head_dim 64: vLLM's CPU attention takes no smaller head
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 8}
STEPS = 12


def _recipe(root: Path, target: Path, name: str, *overrides: str):
    from eyas.config import load_recipe

    return load_recipe(None, _overrides(root, target, name, *overrides))


def _overrides(root: Path, target: Path, name: str, *overrides: str) -> list[str]:
    return [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={root}", f"run.name={name}",
        f"data.source={root / 'rows.jsonl'}", "data.max_length=96", "data.heldout_fraction=0.1",
        "dump.draft_vocab_size=128", "dump.shard_tokens=2000", "dump.token_budget=400", "draft.kind=eagle3",
        "train.token_budget=256", "train.ttt_steps=2", "train.lr=1e-3", "train.warmup_steps=2",
        "train.mixed_precision=fp32", "train.eval_every=0", "train.save_every=0", "train.log_every=1",
        "train.eval_batches=2", f"train.max_steps={STEPS}", "train.epochs=3", "train.prefetch=2",
            "dump.vllm_enforce_eager=true", *overrides]  # eager: an engine starts in seconds, not a compile's minute


def _same_prepared(root: Path, name: str) -> None:
    (root / name).mkdir()
    shutil.copytree(root / "dump" / "prepared", root / name / "prepared")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """(root, target, the vLLM dump's recipe): 40 conversations prepared and dumped through vLLM (fp8 codes)."""
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare

    root = tmp_path_factory.mktemp("stream")
    target = build_tiny_target(root / "target", "llama", **TINY)
    write_chat_rows(root / "rows.jsonl", 40)
    recipe = _recipe(root, target, "dump", "dump.backend=vllm")
    prepare(recipe)
    dump(recipe)
    return root, target, recipe


class Fleet:
    """Two capture engines of the workspace's recipe, started as `eyas engine` starts them; kill/stop/restart."""

    def __init__(self, recipe) -> None:
        from eyas.targets import load_target_config, load_tokenizer, target_identity
        from eyas.train.stream import engine_spec

        config = load_target_config(recipe.target.path)
        self.spec = engine_spec(recipe, config, target_identity(config, load_tokenizer(recipe.target)))
        self.spec.storage = recipe.run_dir.parent / "fleet-hidden"  # the runs below set train.stream_storage to it
        self.spec.storage.mkdir(parents=True, exist_ok=True)
        self.servers = [self.spec.server(free_port(), recipe.run_dir.parent / f"fleet-{e}.log") for e in range(2)]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self, e: int | None = None) -> None:
        for server in self.servers if e is None else [self.servers[e]]:
            server.start()

    def kill(self, e: int) -> None:
        os.killpg(self.servers[e].proc.pid, signal.SIGKILL)
        self.servers[e].proc.wait()

    def signal(self, e: int, sig: int) -> None:
        os.killpg(self.servers[e].proc.pid, sig)

    def requests_done(self, e: int) -> float:
        """Requests engine e has finished (its Prometheus counter)."""
        with urllib.request.urlopen(self.urls[e].removesuffix("/v1") + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def fleet(workspace):
    _, _, recipe = workspace
    engines = Fleet(recipe)
    engines.start()
    yield engines
    engines.stop()


def _streaming(fleet) -> list[str]:
    """The overrides that stream from the module's engines."""
    return ["train.source=stream", "train.stream_engines=0", "train.stream_endpoints=[" + ",".join(fleet.urls) + "]",
            f"train.stream_storage={fleet.spec.storage}"]


def _streamed(workspace, fleet, name: str, *overrides: str):
    """A recipe streaming from the module's engines, on a copy of the dump's prepared data."""
    root, target, _ = workspace
    _same_prepared(root, name)
    return _recipe(root, target, name, *_streaming(fleet), *overrides)


def _weights(result: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result["checkpoint"]) / "model.safetensors"))


def _report(recipe) -> dict:
    return json.loads((recipe.run_dir / "stream" / "report.rank0.json").read_text())


# ----------------------------------------------------------------------------- the same numbers


def test_a_streamed_run_equals_the_run_from_the_vllm_dump(workspace):
    """The stream's codes are the vLLM dump's within one fp8 step, and training on them takes the dump's batches in
    the dump's order, with losses and weights equal within fp32 rounding (the run starts its own engine)."""
    from eyas.data.shard_reader import ShardReader
    from eyas.train.loop import train
    from eyas.train.metrics import logged_losses

    root, target, dumped = workspace
    _same_prepared(root, "own-engine")
    streamed = _recipe(root, target, "own-engine", "train.source=stream", "train.stream_cache=keep",
                       "train.stream_window=8", "train.stream_engines=1", f"train.stream_port={free_port()}")
    from_stream, from_shards = train(streamed), train(dumped)

    report = _report(streamed)
    assert report["fleet"]["captures"] == report["train"]["samples"] + report["heldout"]["samples"]  # once each
    shards = ShardReader(dumped.run_dir / "shards")
    cache = Path(report["train"]["cache"])
    differing = total = 0
    for i in range(len(shards)):
        want, got = shards.codes(i), load_file(str(cache / f"{i}.safetensors"))
        assert set(got) == set(want)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        for name in got:
            if got[name].dtype == torch.float8_e4m3fn:
                steps = (got[name].view(torch.uint8).int() - want[name].view(torch.uint8).int()).abs()
                assert int(steps.max()) <= 1, f"sample {i} {name}: codes more than one fp8 step from the dump's"
                differing, total = differing + int((steps > 0).sum()), total + steps.numel()
    print(f"stream vs vLLM dump: {differing} of {total} fp8 codes one step apart ({differing / total:.2e})")
    assert differing / total < 1e-3

    got, want = logged_losses(streamed.run_dir), logged_losses(dumped.run_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), f"step {step}"
    for name, weight in _weights(from_shards).items():
        torch.testing.assert_close(_weights(from_stream)[name], weight, rtol=1e-3, atol=1e-5, msg=name)
    assert sum(_report(streamed)["train"]["trained"]) > 0


# ----------------------------------------------------------------------------- faults


def test_an_engine_killed_mid_run_loses_and_repeats_no_sample(workspace, fleet):
    """Engine 0 killed after it answered its first captures, restarted later: its in-flight samples are asked of
    engine 1 (or of it again once it is back), and every sample goes into a step as often as in the run without
    the kill."""
    from eyas.train.loop import train

    clean = _streamed(workspace, fleet, "kill-clean", "train.stream_window=4")
    train(clean)
    killed = _streamed(workspace, fleet, "kill", "train.stream_window=4")
    before = fleet.requests_done(0)

    def kill_then_restart() -> None:
        while fleet.requests_done(0) < before + 3:
            time.sleep(0.05)
        fleet.kill(0)
        time.sleep(5)
        fleet.start(0)

    killer = threading.Thread(target=kill_then_restart)
    killer.start()
    train(killed)
    killer.join()
    got, want = _report(killed), _report(clean)
    assert got["fleet"]["retries"] > 0, "the kill landed after the run's last capture"
    assert got["train"]["trained"] == want["train"]["trained"]
    assert sum(got["train"]["trained"]) > 0


def test_a_trainer_killed_resumes_bitwise(workspace, fleet):
    """The trainer stopped after step 5 (as preempted) and resumed ends with the weights and losses of the run never
    stopped: the stream's position is the loader's, in the checkpoint, and each capture is the sample's alone."""
    from eyas.train.loop import train
    from eyas.train.metrics import first_loss_difference, logged_losses

    whole = _streamed(workspace, fleet, "whole")
    resumed = _streamed(workspace, fleet, "resumed")
    whole_result = train(whole)
    assert train(resumed, stop_at_step=5)["step"] == 5
    resumed_result = train(resumed)
    assert first_loss_difference(logged_losses(resumed.run_dir), logged_losses(whole.run_dir)) is None
    for name, weight in _weights(whole_result).items():
        assert torch.equal(_weights(resumed_result)[name], weight), name


def test_a_stalled_engine_is_named_not_waited_on(workspace, fleet):
    """An engine that stops answering mid-run (SIGSTOP after its first captures: it still accepts connections):
    an error naming it after train.stream_timeout_s, not a hang."""
    from eyas.train.loop import train

    recipe = _streamed(workspace, fleet, "stall", "train.stream_timeout_s=15", "train.stream_window=4")
    recipe.train.stream_endpoints = [fleet.urls[0]]
    before = fleet.requests_done(0)

    def stall() -> None:
        while fleet.requests_done(0) < before + 2:
            time.sleep(0.05)
        fleet.signal(0, signal.SIGSTOP)

    staller = threading.Thread(target=stall)
    staller.start()
    try:
        with pytest.raises(EyasError, match=rf"engine at {fleet.urls[0]} took sample \d+ and answered nothing in 15 s"):
            train(recipe)
    finally:
        staller.join()
        fleet.signal(0, signal.SIGCONT)


def test_an_engine_of_other_layers_is_refused_with_the_fix(workspace, fleet):
    from eyas.train.loop import train

    recipe = _streamed(workspace, fleet, "other-layers", "dump.layers=[1,3,5]")
    with pytest.raises(EyasError, match=r"captures layers \[2, 4, 5, 8\], this run reads \[1, 3, 5, 8\].*eyas engine RECIPE"):
        train(recipe)


# ----------------------------------------------------------------------------- fleets


def _torchrun(overrides: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "eyas.train", *overrides],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _tokens(run: Path) -> list[int]:
    rows = map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines())
    return [row["tokens"] for row in rows if row["kind"] == "train"]


def test_two_engines_feed_two_trainer_processes_as_the_dump_would(workspace, fleet):
    """2 engines + 2 trainer processes (gloo): the same global batches and losses as 2 processes reading the dump's
    shards, and between them the two ranks train every sample as often as those do."""
    from eyas.train.metrics import logged_losses

    root, target, _ = workspace
    for name in ("fleet-2x2", "shards-2"):
        _same_prepared(root, name)
    shutil.copytree(root / "dump" / "shards", root / "shards-2" / "shards")
    _torchrun(_overrides(root, target, "fleet-2x2", *_streaming(fleet)))
    _torchrun(_overrides(root, target, "shards-2"))
    got, want = logged_losses(root / "fleet-2x2"), logged_losses(root / "shards-2")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), f"step {step}"
    assert _tokens(root / "fleet-2x2") == _tokens(root / "shards-2")  # the same global batches
    reports = [json.loads((root / "fleet-2x2" / "stream" / f"report.rank{r}.json").read_text()) for r in (0, 1)]
    assert all(sum(r["train"]["trained"]) > 0 for r in reports)  # both ranks trained on streamed samples
    answered = [sum(r["fleet"]["engines"][url]["answered"] for r in reports) for url in fleet.urls]
    assert all(n > 0 for n in answered), f"an engine answered nothing: {answered}"
