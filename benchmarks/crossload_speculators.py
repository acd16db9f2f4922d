"""Cross-load check: an eyas `dspark` draft exported with `eyas export --to vllm` (speculators' `dspark` format)
is read by speculators 0.9.0's own `DSparkDraftModel.from_pretrained`, and that model gives the eyas head's own
draft logits and confidences on every compared (anchor, block row) pair.

Run (speculators is installed apart from eyas's environment, without its dependencies; the script installs it
into --peers when that folder lacks it, as benchmarks/bench_peer_speculators.py does):
    pip install --no-deps --target /tmp/peers/speculators speculators==0.9.0 hs-connectors==0.9.0
    python benchmarks/crossload_speculators.py --peers /tmp/peers/speculators --out /tmp/crossload.json
It exits 1 when a logit or confidence differs by more than --atol (1e-4) x the largest logit magnitude.
`--smoke`: a shorter sequence; speculators only when --peers names a folder holding it (no install), else
eyas's own reader of the export (`eyas.train.export.load_exported`) stands in for it (`peer: stand-in` in the
JSON), so the script's plumbing still runs without the network.

What it does, all on the CPU in fp32:
  * builds tests/fixtures.py's tiny target (--family: Llama by default, hidden 64, 6 layers, vocab 384) and a
    random eyas dspark head on it (fixtures' `random_head`: 2 layers, K = 3 rows per block, Markov rank 16),
    with the Markov head scaled x30 as tests/test_dspark.py does so that its bias changes the drafts;
  * the head has a REDUCED draft vocabulary (200 of 384 tokens, lm_head saved with d2t/t2d): speculators
    rebuilds a full-vocabulary draft's lm_head from the verifier's and ignores a saved one (its DFlash
    `load_verifier_weights` overwrites lm_head when `not use_draft_vocab`), while eyas trains its lm_head, so
    only a reduced vocabulary can compare equal;
  * saves the checkpoint with meta {"target_path": <the tiny target>} and exports it (`export_draft(..., "vllm",
    dtype="float32", speculative_tokens=K)`), so the config's verifier `name_or_path` is the target's folder:
    speculators reads the embedding (the mask rows' and anchors' token embeddings) and its own verifier head
    from there;
  * loads it with `DSparkDraftModel.from_pretrained` (eager attention: its default flex attention compiles
    through triton, which this CPU has not), checks that every exported tensor landed unchanged in the model and
    that no parameter is left at speculators' NaN "not loaded" fill;
  * runs speculators' own `_backbone_forward` (its anchor choice, block positions, attention mask, layers, norm
    and lm_head) plus its Markov `block_bias` and `confidence_head` on [hidden; Markov embedding of the token at
    the row's position] exactly as its `forward` does before the loss (the loss itself needs triton and is not
    what is compared). Every position 1..T-K-1 is an anchor: the loss mask is set from position 1 (the block at
    position 0 has no context, and eyas's first block is anchored at position 1) and `max_anchors` equals the
    number of positions it may pick, so its random anchor draw takes all of them;
  * compares, for each anchor p it picked and block row k, its logits and confidence with eyas's training
    forward `eyas.train.ttt.block_steps` step k at slot t = p - 1 (the block anchored at x_p, row k predicting
    x_{p+k+1}); the verifier's last hidden state is passed only because speculators builds its loss targets from
    it.

Found (speculators 0.9.0, transformers 5.19, torch 2.13 CPU, 2 busy cores; tiny Llama target, 2 rows of 64
tokens, anchors 1..60, K = 3): the export loads as it is, nothing changed for speculators. All 360 (anchor, row)
pairs agree: max |logit difference| 3.8e-6 against a largest |logit| of 15.3 (tolerance 1.5e-3), max |confidence
logit difference| 8.9e-8, the same argmax on all 360, of which the Markov bias changes 202 (so the bias is
compared, not negligible). Every exported tensor loaded unchanged (lm_head, d2t and t2d included), none was left
unused or at speculators' NaN fill; the model rebuilt only embed_tokens, verifier_lm_head and verifier_norm (from
the target's folder) and the rotary buffers; its config read K = 3, sample_from_anchor, rank 16, the vanilla
Markov head, the confidence head over [h; W1], draft vocabulary 200 and eyas's mask token. A Qwen3-MoE-shaped
target (--family qwen3_moe) agrees as well (4.3e-6 of 14.3). Negative controls run by hand: the exported
markov_w2 scaled by 1.01 gives 6.8e-2 (exit 1); comparing eyas's slot p instead of p-1 gives 18.5 (exit 1).
Time: about 12 s (7 s building the target, head and export with the imports, 5 s comparing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import machine  # benchmarks/machine.py

RESULTS = machine.RESULTS / "crossload_speculators.json"
STAND_IN = "stand-in: eyas's own reader of the export (load_exported) in speculators' place (--smoke without it)"
PEER_FIELDS = ("block_size", "sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
               "confidence_head_with_markov", "draft_vocab_size", "mask_token_id", "aux_hidden_state_layer_ids",
               "sliding_window_non_causal")
DRAFT_VOCAB = 200  # of the tiny target's 384 tokens: a reduced vocabulary (see the module docstring)


# ----------------------------------------------------------------------------- the two sides


def load_dspark_class(site: str, install: bool):
    """speculators' DSparkDraftModel from `site` (pip --target, no dependencies; installed when missing and
    `install`), or None when it is not there."""
    if not machine.use_peer(machine.SPECULATORS, site, "crossload_speculators", install):
        return None
    from speculators.models.dspark.core import DSparkDraftModel

    return DSparkDraftModel


def eyas_draft(work: Path, family: str, layers: int, steps: int, rank: int, seed: int):
    """(head, target, export folder): a random dspark head over a reduced vocabulary on a tiny target built in
    `work`, its Markov head sharpened, saved and exported in speculators' dspark format."""
    import torch

    from eyas.draft.checkpoint import save_draft
    from eyas.train.export import export_draft

    fixtures = machine.tests_module("fixtures")
    target_dir = fixtures.build_tiny_target(work / "target", family)
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    kept = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB].sort().values
    head, target, _ = fixtures.random_head(target_dir, "dspark", kept - torch.arange(len(kept)), seed, num_steps=steps,
                                  num_layers=layers, markov_rank=rank)
    with torch.no_grad():  # a random bias is ~1e-3 (two 0.02-std factors): scaled so that it changes the drafts
        head.markov_head.markov_w1.weight.mul_(30.0)
        head.markov_head.markov_w2.weight.mul_(30.0)
    checkpoint = save_draft(work / "checkpoint", head, {"step": 0, "target_path": str(target_dir)})
    out = export_draft(checkpoint, "vllm", work / "export", dtype="float32", speculative_tokens=steps)
    return head.eval(), target, out


def load_peer(dspark_class, export: Path):
    """speculators' model of the export, with eager attention (flex attention needs triton) in fp32."""
    config = dspark_class.config_class.from_pretrained(str(export))
    config.transformer_layer_config._attn_implementation = "eager"
    return dspark_class.from_pretrained(str(export), config=config).float().eval()


def loaded_check(model, export: Path) -> dict:
    """Every exported tensor equal to the model's tensor of that name; the model's tensors the export lacks (the
    verifier's, rebuilt from its folder) and any still at speculators' NaN fill (a weight nothing loaded)."""
    from safetensors.torch import load_file

    saved = load_file(str(export / "model.safetensors"))
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {"unused_in_export": sorted(set(saved) - set(own)),
            "differ_from_export": sorted(n for n in set(saved) & set(own)
                                         if not bool((saved[n].to(own[n].dtype) == own[n]).all())),
            "rebuilt_by_peer": sorted(set(own) - set(saved)),
            "nan_left": sorted(n for n, t in own.items() if t.is_floating_point() and bool(t.isnan().any())),
            # what its config class made of eyas's fields (a field it did not know would fall back to its default)
            "peer_config": {key: getattr(model.config, key) for key in PEER_FIELDS},
            "peer_use_draft_vocab": bool(model.use_draft_vocab)}


def peer_blocks(model, input_ids, features, last_hidden, steps: int):
    """(anchors [A], logits [A, K, V], confidence logits [A, K]) of speculators' forward before its loss."""
    import torch

    seq = input_ids.shape[1]
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, 0] = 0  # no block at position 0: eyas's first block is anchored at position 1
    anchors_wanted = int(loss_mask[:, :seq - steps].sum())  # all positions its anchor draw may pick
    hidden, logits, _, _, indices = model._backbone_forward(
        features, input_ids, loss_mask, last_hidden, torch.zeros_like(input_ids), max_anchors=anchors_wanted)
    blocks = indices.view(anchors_wanted, steps)
    prev = input_ids[0, blocks]  # the token at each row's own position (the anchor for row 0)
    rows = hidden.view(anchors_wanted, steps, -1)
    prev_emb = model.markov_head.prev_embeddings(prev)
    logits = logits.view(anchors_wanted, steps, -1) + model.markov_head.block_bias(
        prev_token_ids=prev, hidden_states=rows, prev_emb=prev_emb)
    confidence = model.confidence_head(torch.cat([rows, prev_emb.to(rows.dtype)], dim=-1))
    return blocks[:, 0], logits, confidence


def stand_in_blocks(back, input_ids, features, steps: int):
    """The same (anchor, row) pairs from eyas's own read-back of the export (--smoke without speculators)."""
    import torch

    from eyas.train.ttt import block_steps

    anchors = torch.arange(1, input_ids.shape[1] - steps)
    per_step = block_steps(back, input_ids, features, steps)
    return (anchors, torch.stack([per_step[k][0][0, anchors - 1] for k in range(steps)], dim=1),
            torch.stack([per_step[k][1][0, anchors - 1] for k in range(steps)], dim=1))


def eyas_blocks(head, input_ids, features, anchors, steps: int):
    """eyas's logits [A, K, V], confidences [A, K] and Markov-free logits of the blocks anchored at `anchors`:
    step k at slot p - 1, plus the bias-free logits (to show the bias changes the drafts)."""
    import torch

    from eyas.train.ttt import block_steps

    slots = anchors - 1
    per_step = block_steps(head, input_ids, features, steps)
    rows = head.training_rows(input_ids, features, steps)[0, slots]  # [A, K, H]
    return (torch.stack([per_step[k][0][0, slots] for k in range(steps)], dim=1),
            torch.stack([per_step[k][1][0, slots] for k in range(steps)], dim=1), head.lm_head(rows))


# ----------------------------------------------------------------------------- the comparison


def compare_sequence(head, target, peer, input_ids, steps: int) -> dict:
    """One token row through the target (features, last hidden state), the peer and eyas: the differences."""
    import torch

    with torch.inference_mode():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in head.config.aux_layers], dim=-1)
        if peer["kind"] == "speculators":
            anchors, logits, confidence = peer_blocks(peer["model"], input_ids, features, hidden[-1], steps)
        else:
            anchors, logits, confidence = stand_in_blocks(peer["model"], input_ids, features, steps)
        if int(anchors.min()) < 1:
            raise SystemExit(f"the peer anchored a block at position {int(anchors.min())}, which eyas has no slot for")
        ours, our_confidence, no_bias = eyas_blocks(head, input_ids, features, anchors, steps)
    diff = (logits - ours).abs()
    return {"anchors": anchors.tolist(), "pairs": int(anchors.numel()) * steps,
            "max_abs_logit_diff": float(diff.max()),
            "max_abs_logit_diff_per_row": [float(diff[:, k].max()) for k in range(steps)],
            "max_abs_logit": float(ours.abs().max()),
            "max_abs_confidence_diff": float((confidence - our_confidence).abs().max()),
            "max_abs_confidence": float(our_confidence.abs().max()),
            "argmax_equal": int((logits.argmax(-1) == ours.argmax(-1)).sum()),
            "argmax_changed_by_markov": int((no_bias.argmax(-1) != ours.argmax(-1)).sum())}


def summary(sequences: list[dict], atol: float) -> dict:
    scale = max(s["max_abs_logit"] for s in sequences)
    logit_diff = max(s["max_abs_logit_diff"] for s in sequences)
    confidence_diff = max(s["max_abs_confidence_diff"] for s in sequences)
    confidence_scale = max(1.0, max(s["max_abs_confidence"] for s in sequences))
    return {"pairs": sum(s["pairs"] for s in sequences), "max_abs_logit_diff": logit_diff,
            "max_abs_logit": scale, "max_abs_confidence_diff": confidence_diff,
            "argmax_equal": sum(s["argmax_equal"] for s in sequences),
            "argmax_changed_by_markov": sum(s["argmax_changed_by_markov"] for s in sequences),
            "tolerance": {"logits": atol * scale, "confidence": atol * confidence_scale},
            "equal": logit_diff <= atol * scale and confidence_diff <= atol * confidence_scale}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", help=f"folder with speculators installed by pip --target (default {machine.SPECULATORS.site}; "
                        "installed there when missing); --smoke uses it only when given and holding it")
    # not qwen2: its q/k/v biases without an o_proj bias have no place in the Qwen3 layer speculators and vLLM
    # build (attention_bias covers all four), so eyas's export refuses such a draft (eyas.draft.formats.llama_biases)
    parser.add_argument("--family", default="llama", choices=("llama", "qwen3_moe"),
                        help="the tiny target's shape (tests/fixtures.py)")
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    parser.add_argument("--steps", type=int, default=3, help="K: rows per block (draft.num_steps)")
    parser.add_argument("--markov-rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=2, help="random token rows compared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=1e-4, help="allowed difference, relative to the largest logit")
    parser.add_argument("--work", help="scratch folder (target, checkpoint, export; default: a temp folder)")
    machine.add_report_args(parser, "crossload_speculators.json", "one 24-token row; the peer only from a given --peers")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the verifier is a local folder: nothing to download
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    machine.apply_smoke(args, "crossload_speculators", target=False, seq_len=24, sequences=1)
    work = Path(args.work) if args.work else (machine.smoke_dir("crossload_speculators") if args.smoke
                                              else Path(tempfile.mkdtemp(prefix="crossload-speculators-")))
    out = machine.output_path(args.out, RESULTS, args.smoke, work)
    started = time.perf_counter()

    import torch

    torch.manual_seed(args.seed)
    site = args.peers or (None if args.smoke else machine.SPECULATORS.site)  # a smoke run installs nothing
    dspark_class = load_dspark_class(site, install=not args.smoke) if site else None
    head, target, export = eyas_draft(work, args.family, args.layers, args.steps, args.markov_rank, args.seed)
    built = time.perf_counter()
    if dspark_class is not None:
        peer = {"kind": "speculators", "model": load_peer(dspark_class, export)}
        loading = loaded_check(peer["model"], export)
    else:
        from eyas.train.export import load_exported

        peer = {"kind": "stand-in", "model": load_exported(export, target.get_input_embeddings().weight).eval()}
        loading = {}
    loaded = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed + 1)
    rows = [torch.randint(3, target.config.vocab_size, (1, args.seq_len), generator=generator)
            for _ in range(args.sequences)]
    sequences = [compare_sequence(head, target, peer, ids, args.steps) for ids in rows]
    result = summary(sequences, args.atol)
    if loading and (loading["differ_from_export"] or loading["nan_left"] or loading["unused_in_export"]):
        result["equal"] = False  # a tensor dropped or changed on load is a failed cross-load, whatever the logits
    seconds = {"build_and_export": built - started, "load": loaded - built, "compare": time.perf_counter() - loaded,
               "total": time.perf_counter() - started}
    report = {"peer": STAND_IN if peer["kind"] == "stand-in" else list(machine.SPECULATORS.packages),
              "export": str(export), "config": json.loads((export / "config.json").read_text()),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
              "result": result, "loading": loading, "sequences": sequences, "seconds": seconds,
              **machine.environment("transformers", "safetensors", "speculators")}
    machine.write_json(out, report)
    machine.bench_lines(f"crossload_speculators_pairs {result['pairs']} pairs",
                        f"crossload_speculators_max_logit_diff {result['max_abs_logit_diff']:.3e} abs "
                        f"(max |logit| {result['max_abs_logit']:.2f}, tolerance {result['tolerance']['logits']:.2e})",
                        f"crossload_speculators_max_confidence_diff {result['max_abs_confidence_diff']:.3e} abs",
                        f"crossload_speculators_seconds {seconds['total']:.1f} s")
    print(f"crossload_speculators: peer {peer['kind']}, {'EQUAL' if result['equal'] else 'DIFFERENT'}; "
          f"loading {json.dumps(loading)}; wrote {out}")
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
