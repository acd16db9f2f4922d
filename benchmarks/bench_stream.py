"""Streamed training (`train.source: stream`) against dump-then-train, on the same prepared SmolLM2 data, in one run.

Run: `python benchmarks/bench_stream.py` (about 12 minutes on 2 CPU cores; `--samples`, `--max-length`, `--steps`,
`--window` for another run; `--smoke`: a tiny target and a few steps, figures that measure nothing).

Each core has one job: the capture engine (`eyas engine`, its threads bound to core 1) and the trainer (pinned to
core 0), so the trainer's rate from the stream is set by the engine keeping up, not by the two sharing a core.

- Trainer tokens/s: the median of the logged steps after the first three, training from the vLLM dump's shards and
  from the stream (same recipe, seed and steps; the dump arm's engine is gone by then); the ratio stream / shards.
- Time to the first optimizer step: dump-then-train is `eyas dump` (dump.backend vllm, its engine start included)
  plus the trainer's start to its first logged step; the stream is the engine's start (`eyas engine` until it
  answers) plus the trainer's start to its first step. The ratio stream / dump-then-train.
- Disk and host high-water marks of the stream: the engine's files folder, polled every 20 ms during the run, and
  the fleet's finished-but-unread captures as stored codes (its report), each as a share of the offline dump's size
  on disk. Both scale with the window, not the data: `window / samples` of the dump at most, for the host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import add_report_args, apply_smoke, environment, figure_lines, output_path, publish, run_record

from eyas.cpus import allowed_cpus

RESULTS = Path(__file__).parent / "results" / "bench_stream.json"
TRAIN = ("draft.kind=eagle3", "dump.draft_vocab_size=2048", "train.token_budget=2048", "train.lr=1e-3",
         "train.warmup_steps=4", "train.ttt_steps=3", "train.epochs=1", "train.mixed_precision=fp32",
         "train.eval_every=0", "train.save_every=0", "train.log_every=1", "train.eval_batches=1", "train.prefetch=2")


def _overrides(args, root: Path, name: str, *extra: str) -> list[str]:
    return [f"target.path={args.target}", "target.dtype=float32", f"run.output_dir={root}", f"run.name={name}",
            "data.source=chitchat", f"data.max_samples={args.samples}", f"data.max_length={args.max_length}",
            "data.heldout_fraction=0.02", "dump.backend=vllm", "dump.token_budget=4096", "dump.shard_tokens=262144",
            *TRAIN, f"train.max_steps={args.steps}", *(["dump.vllm_enforce_eager=true"] if args.smoke else []), *extra]


def _pinned(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None else []


def _eyas(stage: str, overrides: list[str], log: Path, core: int | None, env: dict | None = None) -> subprocess.Popen:
    handle = open(log, "a")
    return subprocess.Popen([*_pinned(core), sys.executable, "-m", "eyas.cli", stage, *overrides], stdout=handle,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})})


def _finish(proc: subprocess.Popen, what: str, log: Path) -> None:
    if proc.wait() != 0:
        sys.exit(f"bench_stream: {what} failed (exit {proc.returncode}); see {log}")


def _train_timed(overrides: list[str], run: Path, log: Path, core: int | None, watch: Path | None = None) -> dict:
    """One `eyas train`: seconds from its start to its first logged step, the steady tokens/s, and (`watch`) the
    folder's largest size while it ran."""
    metrics = run / "logs" / "metrics.jsonl"
    started, first, most = time.perf_counter(), None, 0
    proc = _eyas("train", overrides, log, core)
    while proc.poll() is None:
        if first is None and metrics.is_file() and metrics.stat().st_size:
            first = time.perf_counter() - started
        if watch is not None and watch.is_dir():
            most = max(most, sum(f.stat().st_size for f in watch.iterdir() if f.is_file()))
        time.sleep(0.02)
    _finish(proc, "eyas train", log)
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    rates = [r["tokens_per_s"] for r in rows[3:]] or [r["tokens_per_s"] for r in rows]
    return {"first_step_s": first, "tokens_per_s": statistics.median(rates), "steps": len(rows), "disk_most": most}


def _start_engine(overrides: list[str], run: Path, log: Path, core: int | None, port: int) -> tuple:
    from eyas.vllm_server import answers

    started = time.perf_counter()
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)} if core is not None else {}
    proc = _eyas("engine", [*overrides, "--port", str(port), "--host", "127.0.0.1"], log, core, env)
    while True:
        if proc.poll() is not None:
            sys.exit(f"bench_stream: the engine exited (status {proc.returncode}); see {log}")
        if answers(f"http://127.0.0.1:{port}/v1", timeout=2):
            return proc, time.perf_counter() - started
        time.sleep(0.2)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=800, help="chitchat conversations prepared")
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of 2,048 tokens each arm trains")
    parser.add_argument("--window", type=int, default=16, help="train.stream_window: samples asked ahead")
    parser.add_argument("--work", help="folder for the runs and their logs (default: a new temporary folder)")
    add_report_args(parser, RESULTS.name, "a tiny target, 60 conversations and 6 steps; figures that measure nothing")
    args = parser.parse_args(argv)
    folder = apply_smoke(args, "bench_stream", samples=60, max_length=96, steps=6)
    out = output_path(args.out, RESULTS, args.smoke, folder)
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="eyas-bench-stream-", dir=folder))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"bench_stream: runs and logs in {root}", flush=True)
    cpus = allowed_cpus()
    trainer_core, engine_core = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    logs = root / "logs"
    logs.mkdir()

    from eyas.vllm_server import free_port

    # dump-then-train
    dumped = _overrides(args, root, "dumped")
    started = time.perf_counter()
    _finish(_eyas("prepare", dumped, logs / "prepare.log", None), "eyas prepare", logs / "prepare.log")
    prepare_s = time.perf_counter() - started
    started = time.perf_counter()
    _finish(_eyas("dump", dumped, logs / "dump.log", engine_core), "eyas dump", logs / "dump.log")
    dump_s = time.perf_counter() - started
    shards = _train_timed(dumped, root / "dumped", logs / "train-shards.log", trainer_core)
    dump_bytes = _folder_bytes(root / "dumped" / "shards")

    # the stream, on a copy of the same prepared data
    shutil.copytree(root / "dumped" / "prepared", root / "streamed" / "prepared")
    port = free_port()
    storage = root / "streamed" / "stream" / "hidden"
    streamed = _overrides(args, root, "streamed", "train.source=stream", "train.stream_engines=0",
                          f"train.stream_endpoints=[http://127.0.0.1:{port}/v1]", f"train.stream_storage={storage}",
                          f"train.stream_window={args.window}")
    engine, engine_start_s = _start_engine(streamed, root / "streamed", logs / "engine.log", engine_core, port)
    try:
        stream = _train_timed(streamed, root / "streamed", logs / "train-stream.log", trainer_core, watch=storage)
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    report = json.loads((root / "streamed" / "stream" / "report.rank0.json").read_text())

    figures = {
        "trainer_tokens_per_s_ratio": stream["tokens_per_s"] / shards["tokens_per_s"],
        "first_step_ratio": (engine_start_s + stream["first_step_s"]) / (dump_s + shards["first_step_s"]),
        "disk_high_water_share": stream["disk_most"] / dump_bytes,
        "host_high_water_share": report["fleet"]["most_held_bytes"] / dump_bytes,
    }
    record = {**run_record(__file__, argv), "environment": environment("torch", "vllm-cpu", "hs-connectors"),
              "settings": vars(args), "cores": {"trainer": trainer_core, "engine": engine_core},
              "prepare_s": prepare_s, "dump_s": dump_s, "dump_bytes": dump_bytes, "engine_start_s": engine_start_s,
              "shards": shards, "stream": stream, "stream_report": {"fleet": report["fleet"]},
              "figures": figures}
    publish(out, record, figure_lines(figures, {}), "bench_stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
