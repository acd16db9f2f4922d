"""eyas vs SpecForge on the same EAGLE-3 training step, side by side in one process.

Run (the peer is installed apart from eyas's environment, without its GPU dependencies; the
script installs it into --peers when that folder lacks it):
    pip install --no-deps --target /tmp/peers/specforge specforge==0.2.0
    python benchmarks/bench_train_peers.py --peers /tmp/peers/specforge
(about 5-10 minutes on 2 CPU cores at the default shapes.)
    python benchmarks/bench_train_peers.py --smoke     # seconds: a tiny target, 64 tokens, one step
A smoke run uses SpecForge only when --peers names a folder holding it (its first step compiles for
a minute or more); otherwise eyas's own step stands in for the peer's (labelled `peer: stand-in`,
and so in the JSON), so the script's plumbing is still run.

Shapes as `bench_train.py`: hidden 576, 9/3 heads, MLP 1536, target vocabulary 49152, draft
vocabulary 32000, TTT 7, one sequence of 1024 tokens. Like for like: both steps start from the
same in-memory batch (fused layers, last hidden state, ids, loss mask all ones), recompute the
teacher from the last hidden state through the target lm_head restricted to the draft vocabulary
(SpecForge's `compute_target_p_padded_from_hidden`, eyas's `Teacher`), unroll 7 steps with the
EAGLE-3 mask, take forward KL per step weighted 0.8^k, run backward and one AdamW step; the
embedding is frozen and the draft lm_head trained in both. SpecForge runs its `sdpa` attention
backend; its loss module needs triton (GPU), so the torch reference implementation that ships
in the same file (`_compute_loss`, eager) stands in for it. Differences that remain: SpecForge
feeds the data tokens to later steps and also computes its acceptance-rate metric each step;
eyas feeds the draft's own tokens (`train.ttt_token_feed: draft`) and computes accuracy.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from machine import SPECFORGE, add_report_args, apply_smoke, environment, output_path, publish, set_threads, stamp, use_peer

from eyas.cpus import available_cpus

RESULTS = Path(__file__).parent / "results" / "bench_train_peers.json"
STAND_IN = "stand-in: eyas's own step in the peer's place (--smoke without an installed SpecForge in --peers)"


def load_specforge(site: str):
    """SpecForge's EAGLE-3 model classes (from `site`, on sys.path: `use_peer`), with its triton loss replaced by
    its own torch reference."""
    import torch.nn as nn

    tree = ast.parse(Path(site, "specforge/core/loss.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    fn.decorator_list = []  # @torch.compile: eager on a CPU, as the anchors' CPU path runs
    namespace = {"torch": torch, "nn": nn}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "specforge/core/loss.py", "exec"), namespace)
    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = type("LogSoftmaxLoss", (), {"apply": staticmethod(namespace["_compute_loss"])})
    sys.modules["specforge.core.loss"] = module
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    return OnlineEagle3Model, LlamaForCausalLMEagle3


def make_batch(seq: int, hidden: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, vocab, (1, seq), generator=g),
        "loss_mask": torch.ones(1, seq),
        "attention_mask": torch.ones(1, seq, dtype=torch.long),
        "aux_hidden": torch.randn(1, seq, 3 * hidden, generator=g),
        "last_hidden": torch.randn(1, seq, hidden, generator=g),
    }


def eyas_setup(target_config, lm_head: torch.Tensor, d2t: torch.Tensor, ttt: int, chunk: int):
    """eyas's step as its trainer takes it: the head inside `TrainingUnroll` (the module accelerate
    wraps), the teacher through the target lm_head rows, the TTT unroll, loss, backward, AdamW."""
    from eyas.draft.features import default_layers
    from eyas.draft.registry import build_head
    from eyas.recipe_schema import DraftConfig
    from eyas.train.losses import Teacher
    from eyas.train.ttt import TrainingUnroll

    layers = default_layers(int(target_config.num_hidden_layers))  # SmolLM2: 2, 15, 27
    head = build_head(DraftConfig(kind="eagle3"), target_config, layers, d2t)
    model = TrainingUnroll(head)
    optimizer = torch.optim.AdamW(head.trainable_parameters(), lr=1e-4)
    teacher = Teacher(lm_head, d2t, chunk)
    weights = [0.8 ** k for k in range(ttt)]

    def step(batch: dict) -> float:
        out = model(batch, teacher, ttt, {"forward_kl": 1.0}, token_feed="draft")
        loss = sum(w * s / c.clamp(min=1.0) for w, s, c in zip(weights, out["loss_sums"], out["counts"]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, head


def specforge_setup(classes, target_config, lm_head: torch.Tensor, d2t: torch.Tensor, ttt: int, chunk: int):
    from transformers import LlamaConfig

    online_cls, draft_cls = classes
    config = LlamaConfig(
        hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        num_hidden_layers=1, vocab_size=target_config.vocab_size, draft_vocab_size=len(d2t),
        max_position_embeddings=target_config.max_position_embeddings, rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=getattr(target_config, "rope_theta", None) or target_config.rope_parameters["rope_theta"],
        hidden_act="silu", pad_token_id=0,
    )
    draft = draft_cls(config, attention_backend="sdpa")
    target_ids = torch.arange(len(d2t)) + d2t
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.zero_()
        draft.t2d[target_ids] = True
    draft.embed_tokens.weight.requires_grad_(False)
    model = online_cls(draft, length=ttt, attention_backend="sdpa")
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)

    def step(batch: dict) -> float:
        plosses, *_ = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], target=None,
            loss_mask=batch["loss_mask"][..., None], hidden_states=batch["aux_hidden"],
            target_hidden_for_compact=batch["last_hidden"], target_head_weight=lm_head,
            compact_teacher_chunk_size=chunk,
        )
        loss = sum(0.8 ** i * p for i, p in enumerate(plosses))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", help="folder with specforge installed by pip --target (installed there when missing; "
                        f"default {SPECFORGE.site}); --smoke uses the peer only when given here")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=available_cpus())
    parser.add_argument("--target", default="smollm2-135m-instruct")
    add_report_args(parser, "bench_train_peers.json", "seconds: tiny target, 64 tokens, TTT 3, one timed step")
    args = parser.parse_args(argv)
    apply_smoke(args, "bench_train_peers", steps=1, seq=64, ttt=3, draft_vocab=64)
    out = output_path(args.out, RESULTS, args.smoke)
    set_threads(args.threads)
    from eyas.targets import load_target_config
    from eyas.train.data import read_target_weights

    target_config = load_target_config(args.target)
    _, lm_head, _ = read_target_weights(args.target)
    vocab, hidden = lm_head.shape
    d2t = torch.zeros(args.draft_vocab, dtype=torch.long)  # the first draft_vocab ids (speed does not depend on which)
    if not args.smoke:
        args.peers = args.peers or SPECFORGE.site
    # SpecForge's first step compiles for a minute or more: a smoke run takes it only when asked to (never installs it);
    # pip install --no-deps --target: SpecForge's own dependencies (sglang, GPU kernels) stay out
    real_peer = bool(args.peers) and use_peer(SPECFORGE, args.peers, "bench_train_peers", install=not args.smoke)
    peer = "0.2.0 (pip --no-deps; triton loss replaced by its torch reference)" if real_peer else STAND_IN
    print(f"bench_train_peers: peer: {'SpecForge ' + peer if peer != STAND_IN else peer}", flush=True)
    torch.manual_seed(0)
    runners = {"eyas": eyas_setup(target_config, lm_head, d2t, args.ttt, 2048)[0]}
    if peer == STAND_IN:
        runners["specforge"] = eyas_setup(target_config, lm_head, d2t, args.ttt, 2048)[0]
    else:
        runners["specforge"] = specforge_setup(load_specforge(args.peers), target_config, lm_head, d2t, args.ttt, 2048)[0]
    batch = make_batch(args.seq, hidden, vocab)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(args.steps + 1):
        for name, step in runners.items():
            start = time.perf_counter()
            loss = step(batch)
            elapsed = time.perf_counter() - start
            if rep:
                times[name].append(elapsed)
            print(f"bench_train_peers: rep {rep} {name}: {elapsed:.2f} s (loss {loss:.3f})", flush=True)
    rates = {name: args.seq / statistics.median(ts) for name, ts in times.items()}
    figures = {"tokens_per_s": rates, "step_s": times, "eyas_vs_specforge": rates["eyas"] / rates["specforge"]}

    record = {"figures": figures, "settings": vars(args), "peers": {"specforge": peer},
              **environment("transformers", "specforge"), "date": stamp()}
    publish(out, record, [f"train_peer_specforge_tokens_per_s {rates['specforge']:.1f} tokens/s",
                          f"train_peer_eyas_tokens_per_s {rates['eyas']:.1f} tokens/s",
                          f"train_eyas_vs_specforge {figures['eyas_vs_specforge']:.2f} ratio"], "bench_train_peers", newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
