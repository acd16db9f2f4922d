"""The recipe schema: one dataclass per section, every key with its type, default and doc, and the values each accepts.

A recipe has one section per stage (`run`, `target`, `data`, `dump`, `draft`, `train`, `eval`, `export`).
Every key has a default, a type and a one-line doc (the `doc` field metadata), from which
`eyas.recipe_docs.reference_markdown()` renders the key reference of docs/recipes.md. `CHOICES` and the range
tables say what a key accepts (`eyas.recipe_checks.validate` enforces them); `build_section` types a section's
keys as written, naming an unknown or misspelt key and the closest valid ones, or a value of the wrong type.
Reading a recipe file (YAML, overrides) and writing the resolved one: `eyas.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.draft.registry import KINDS
from eyas.errors import EyasError


def _doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its documentation (shown in the README key reference)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class RunConfig:
    name: str = _doc("Run name; the run directory is `<output_dir>/<name>`.", "default")
    output_dir: str = _doc("Parent folder of run directories.", "runs")
    seed: int = _doc("Seed for data order, initialisation and sampling.", 0)


@dataclass
class TargetConfig:
    path: str = _doc(
        "Local HF model directory, or the built-in alias `smollm2-135m-instruct`.",
        "smollm2-135m-instruct",
    )
    dtype: str = _doc("Weights dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.", "auto")
    attn_implementation: str = _doc(
        "Attention kernel: sdpa, eager or flash_attention_2; auto: transformers' own choice for the architecture "
        "(sdpa where the model supports it, else eager: gpt-oss's attention sinks need eager).", "auto")
    device: str = _doc("auto (the launcher's GPU if any, else CPU), cpu, cuda, cuda:N.", "auto")
    chat_template: str = _doc(
        "Path to a Jinja chat template that replaces the tokenizer's own (empty: the tokenizer's).", ""
    )
    trust_remote_code: bool = _doc(
        "Run Python code shipped in the target's folder (its `auto_map` classes). false: such a target is refused "
        "(never an interactive prompt); read the code before setting true.", False
    )


@dataclass
class DataConfig:
    source: str = _doc(
        "`chitchat` (built-in conversations), a JSONL/JSON file, a `datasets` directory saved with save_to_disk, "
        "or `none` (only the target's own prompts, data.self_prompts).",
        "chitchat",
    )
    format: str = _doc("Row format: auto, sharegpt (conversations/from/value), openai (messages/role/content), text.", "auto")
    max_samples: int = _doc("Use at most this many conversations (0: all).", 0)
    heldout_fraction: float = _doc("Fraction of conversations held out for eval, split deterministically by conversation.", 0.02)
    system_prompt: str = _doc("System prompt added to conversations that have none (empty: none added).", "")
    max_length: int = _doc("Longest tokenised sample, in tokens.", 2048)
    max_turns: int = _doc(
        "Keep each conversation's first N exchanges (a user turn and its reply), dropping the rest (0: all).", 0
    )
    overflow: str = _doc("What to do with longer samples: truncate or drop.", "truncate")
    num_proc: int = _doc("Worker processes for tokenisation (datasets.map).", 1)
    regenerate: bool = _doc("Replace assistant turns with the target's own responses.", False)
    regenerate_endpoint: str = _doc(
        "OpenAI-compatible base URL (vLLM, SGLang) for regeneration, and for data.self_prompts (their user turns "
        "through /v1/completions, each request seeded); empty: the target itself, in batches.", ""
    )
    regenerate_max_new_tokens: int = _doc("Longest regenerated assistant turn, in tokens.", 256)
    regenerate_batch_size: int = _doc("Conversations generated together.", 16)
    regenerate_temperature: float = _doc("Sampling temperature for regeneration (0: greedy).", 0.0)
    regenerate_cache: str = _doc(
        "Reply cache of regeneration: every reply is appended as it is made, and a rerun (after a kill, or on "
        "another machine with the file) reuses the replies it holds (empty: <run_dir>/regen_cache.jsonl).", "")
    regenerate_model: str = _doc("Model name sent to regenerate_endpoint (empty: the first one its /v1/models lists).", "")
    regenerate_dtype: str = _doc(
        "Weights dtype of the target while it regenerates (empty: target.dtype). auto: bfloat16 where the machine "
        "runs it natively (a GPU with bf16, a CPU with AMX or AVX512-BF16, about 1.8x faster there; the replies are "
        "then the bf16 target's), else float32.", ""
    )
    self_prompts: int = _doc(
        "Add this many conversations whose user turn the target writes itself (sampled after its template's user "
        "header, the Magpie method); their replies are regenerated, so data.regenerate must be on. 0: none.", 0
    )
    self_prompt_temperature: float = _doc("Sampling temperature of the target-written prompts.", 1.0)
    self_prompt_top_p: float = _doc("Nucleus sampling of the target-written prompts.", 0.95)
    self_prompt_top_k: int = _doc(
        "Sample the target-written prompts from the k most likely tokens only (0: off), with top_p.", 0)
    self_prompt_categories: list = _doc(
        "Steer the target-written prompts over these categories, split evenly: built-in names (writing, roleplay, "
        "reasoning, maths, coding, extraction, stem, humanities, translation, summarisation, qa, passage_qa, chat) "
        "or your own as `{name: \"system prompt\"}` or `{name: {system: ..., openers: [...]}}`. Each attempt gets "
        "its category's system prompt and opening words; the category is recorded on the row. Empty: unsteered.",
        factory=list,
    )
    self_prompt_turns: int = _doc(
        "User turns per target-written conversation: 1, or 2 (the target also writes a follow-up after its own "
        "reply, then answers it).", 1
    )
    self_prompt_dedup: float = _doc(
        "Drop a target-written prompt whose word-3-gram Jaccard similarity to an earlier kept one is at least "
        "this (counted as near-duplicates); 1.0: exact repeats only.", 0.7
    )


@dataclass
class DumpConfig:
    layers: list = _doc(
        "HF `hidden_states` indices of the fused layers (empty: 2, L//2, L-3 as EAGLE-3 uses).", factory=list
    )
    encoding: str = _doc("Feature encoding on disk: bf16, fp16, fp8 (e4m3, per-token scale), int8 (per-token scale) "
                         "or int4 (groups of 32). fp8 keeps about 1/7 of int8's error at the same size.", "fp8")
    teacher: str = _doc(
        "What the teacher distribution is recomputed from: last_hidden (through the frozen lm_head) or topk.", "last_hidden"
    )
    topk: int = _doc("Teacher top-k kept when teacher=topk.", 32)
    token_budget: int = _doc("Tokens per target forward (batches sorted by length, padded to the longest).", 8192)
    shard_tokens: int = _doc("Tokens per shard file.", 262144)
    draft_vocab_size: int = _doc("Size of the reduced draft vocabulary (d2t/t2d); 0 or >= target vocab: full vocab.", 32000)
    low_layer_encoding: str = _doc(
        "Encoding of the lowest fused layer (empty: same as encoding); int4 = 4-bit groups of 32 with a scale each.", ""
    )
    backend: str = _doc(
        "What runs the target: transformers (a forward per batch on this process's device) or vllm (vLLM's "
        "extract_hidden_states, for targets an engine shards: MoE, tensor/expert parallel); the same shards "
        "either way. vllm: teacher last_hidden, RMSNorm families.", "transformers")
    vllm_tensor_parallel_size: int = _doc("dump.backend=vllm: GPUs the target is sharded over (tensor parallel).", 1)
    vllm_expert_parallel: bool = _doc("dump.backend=vllm: shard an MoE target's experts over those GPUs "
                                      "(vLLM's enable_expert_parallel).", False)
    vllm_enforce_eager: bool = _doc(
        "dump.backend=vllm: start the engine without torch.compile or CUDA graphs (vLLM's enforce_eager): seconds "
        "instead of the compile (about 80 s on a CPU, per dump task), for a short dump or a check; a long dump "
        "keeps the compiled engine.", False)


@dataclass
class DraftConfig:
    kind: str = _doc("Draft head kind, one of the registry's (eyas/draft/registry.py; each described in "
                     "docs/heads.md): eagle (EAGLE-1), eagle3 (EAGLE-3), mtp (one layer per step), peagle (EAGLE-3 "
                     "drafting every step from mask slots at once), dflash (a block of tokens per forward), ...",
                     "eagle3")
    num_steps: int = _doc("The most tokens a draft proposes per round where the kind fixes it: mtp's layers (one per "
                          "step), a block kind's slots (dflash: mask rows after the anchor).", 3)
    intermediate_size: int = _doc("MLP width of the draft layer (0: the target's).", 0)
    use_draft_vocab: bool = _doc(
        "Predict over the reduced draft vocabulary (d2t/t2d), for every kind but eagle, which always uses the full "
        "one.", True
    )
    train_lm_head: bool = _doc("Train the draft lm_head (initialised from the target's rows), for a kind that trains "
                               "one (all but eagle and mtp); false freezes it.", True)
    # the recipe's keys of its kind alone (`draft.mtp_feed`, `draft.mask_token_id`, ...), as it set them: checked
    # against the kind's options dataclass (`KindRules.options`, beside the kind's head), written back flat
    options: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    source: str = _doc("shards (from `eyas dump`), online (the frozen target runs in the loop) or stream (vLLM engines "
                       "capture each sample's features as training reads them: docs/stages.md, Streamed training).",
                       "shards")
    stream_engines: int = _doc(
        "train.source stream: capture engines (`vllm serve` of the target) that `eyas train` starts on this node, "
        "at ports train.stream_port, +1, ...; 0: use train.stream_endpoints.", 1)
    stream_endpoints: list = _doc(
        "train.source stream: base URLs (`http://HOST:PORT/v1`) of capture engines already running, each started "
        "with `eyas engine RECIPE` for this run's recipe; when set, train.stream_engines must be 0.", factory=list)
    stream_port: int = _doc("train.source stream: the first local engine's port.", 8470)
    stream_storage: str = _doc(
        "train.source stream: the folder engines write each capture to and trainers read it from (and delete): "
        "one both see, on one node or a shared filesystem; empty: `<run>/stream/hidden`.", "")
    stream_window: int = _doc(
        "train.source stream: samples asked of the engines ahead of the one training reads, per process: what the "
        "stream holds on disk and in host memory at most, whatever the dataset's size.", 64)
    stream_batch: int = _doc(
        "train.source stream: samples a local engine computes together (vLLM's --max-num-seqs). 1: each sample's "
        "features are computed alone, so they are bitwise the same in a rerun or a resume whatever else the engine "
        "was asked; more: short samples share a forward (throughput), and the features vary in the last bits with "
        "what shared it.", 1)
    stream_timeout_s: int = _doc(
        "train.source stream: seconds one capture may take before the engine that holds it is named as stalled "
        "(an error, not a hang), and how long a sample waits for some engine to answer when all are down.", 600)
    stream_cache: str = _doc(
        "train.source stream: what epochs after the first read. keep: the captured features, kept encoded under "
        "the run's stream/cache/ as the first epoch reads them; none: they are streamed again; auto: keep when "
        "the run trains more than one epoch and the cache fits in half the free disk (`eyas plan` says which).",
        "auto")
    epochs: float = _doc("Passes over the training shards.", 1.0)
    max_steps: int = _doc("Stop after this many optimizer steps (0: epochs decide).", 0)
    token_budget: int = _doc("Tokens per micro-batch per process.", 8192)
    grad_accum: int = _doc("Micro-batches per optimizer step.", 1)
    lr: float = _doc("Peak learning rate (AdamW).", 1e-4)
    min_lr_ratio: float = _doc("Final learning rate as a fraction of lr (cosine decay).", 0.1)
    warmup_steps: int = _doc("Linear warmup steps.", 100)
    weight_decay: float = _doc("AdamW weight decay.", 0.0)
    betas: list = _doc("AdamW betas.", factory=lambda: [0.9, 0.95])
    max_grad_norm: float = _doc("Gradient clipping norm (0: off).", 0.5)
    ttt_steps: int = _doc("eagle3/mtp: training-time-test unroll length (mtp: equal to draft.num_steps, one step per layer).", 7)
    ttt_decay: float = _doc("Weight of unrolled step k is ttt_decay**k.", 0.8)
    ttt_ramp_steps: int = _doc(
        "eagle3/mtp: start the unroll shallow: depth 1 at step 0, one step deeper every ttt_ramp_steps/ttt_steps "
        "optimizer steps, the full ttt_steps from then on (0: full depth from the start).", 0)
    draft_init: str = _doc(
        "random (normal(0, initializer_range)) or target_last_layer: the draft's decoder layer(s) start from the "
        "target's last decoder layer where shapes allow (attention, MLP, norms; eagle3's q/k/v in their feature half).",
        "random")
    loss: str = _doc("Distribution loss: forward_kl, ce, tv, jsd, lk (-log of the acceptance rate), topk (HASS's "
                     "top-K distillation: -sum p log q over the teacher's train.tree_width most likely tokens), "
                     "or a mix like `forward_kl:0.9,ce:0.1`; `confidence` (BCE of a confidence head towards the "
                     "step's acceptance rate) for a kind that has one (dspark).", "forward_kl")
    feature_loss_weight: float = _doc("eagle: weight of the smooth-L1 feature regression.", 1.0)
    teacher_chunk: int = _doc("Positions per chunk when recomputing the teacher through lm_head.", 2048)
    checkpoint_unroll: bool = _doc(
        "Recompute each unrolled step (layer, lm_head, loss) in the backward instead of keeping its activations "
        "(about one more forward per step); for long sequences, see docs/results.md (Long sequences).", False)
    mixed_precision: str = _doc(
        "auto (bf16 where the machine runs it natively: a GPU with bf16, a CPU with AMX or AVX512-BF16; else fp32), "
        "fp32 (or no), bf16 or fp16.", "auto")
    eval_every: int = _doc("Held-out evaluation every N steps (0: only at the end).", 500)
    eval_batches: int = _doc("Held-out micro-batches per evaluation.", 20)
    save_every: int = _doc("Checkpoint every N steps (0: only at the end).", 500)
    keep_last: int = _doc("Checkpoints kept (the best by held-out acceptance is kept besides).", 2)
    select_shape: str = _doc(
        "The draft shape `checkpoints/best` is chosen for: the checkpoint with the highest simulated acceptance of "
        "this shape on the held-out shards (from the per-step ranks of the target's token among the draft's, up to "
        "the unroll's depth); empty: the first of eval.shapes. The choice and its figure are recorded in best/'s "
        "config.json meta (`selected_by`).", "")
    tree_width: int = _doc(
        "The width of the tree the tree-aware levers train for (the `topk` loss term's K, train.sibling_feed, "
        "train.align_mask): how many of the draft's ranks a tree drafts from at a depth; 0: train.select_shape's "
        "(1 for a chain, K for dynamic:...,topk=K).", 0)
    sibling_feed: bool = _doc(
        "Unroll along the branch a tree of train.tree_width continues: a step reads the target's token where it was "
        "among the previous step's top-W drafts, else the draft's own first choice (the draft feed). For a kind whose "
        "unrolled steps read the drafted token (eagle, eagle3; mtp with ttt_token_feed: draft). Off by default; the "
        "quickstart and smollm2-eagle3 recipes turn it on with train.align_mask (docs/results.md, Training for a "
        "tree).", False)
    align_mask: bool = _doc(
        "GRIFFIN's alignment mask: a slot's step k is scored only while the target's token was among the draft's "
        "top train.tree_width at every earlier step of that slot (a position no tree of that width reaches trains "
        "nothing); the loss keeps the full mask's normalisation. Off by default; the quickstart and smollm2-eagle3 "
        "recipes turn it on (docs/results.md, Training for a tree).", False)
    dist_timeout_s: int = _doc(
        "Seconds a collective may wait (the process group's timeout), and the bound on what the main process does "
        "alone while the others wait (sign, publish and prune a checkpoint, hash one before a resume, convert a "
        "DeepSpeed state): past it every rank stops with an error naming the step. Raise it for a slow shared "
        "filesystem.", 1800)
    log_every: int = _doc("Log metrics every N steps.", 10)
    logger: str = _doc("none, wandb (offline without an API key) or tensorboard.", "none")
    resume: bool = _doc("Resume from the newest checkpoint in the run directory if there is one.", True)
    trust_checkpoint: str = _doc(
        "Path of a checkpoint to resume from although its training state has no valid digest from your key (written "
        "before eyas signed checkpoints, by another user, or changed since): a resume unpickles that state, so accept "
        "only one you trust (docs/reliability.md, Trust model). Empty: resume only from states eyas signed.", "")
    ttt_token_feed: str = _doc(
        "Token an unrolled step reads: draft (the previous step's own argmax, as at inference), data "
        "(teacher forcing) or auto (draft for eagle/eagle3, data for mtp, whose layers see data tokens as context).",
        "auto",
    )
    prefetch: int = _doc("Batches read ahead: per loader worker, or by one background thread when loader_workers is 0 "
                         "(0 then: read in the training thread).", 2)
    loader_workers: int = _doc(
        "Worker processes that read and pad the shard batches as stored codes (decoded on the training GPU; on a CPU, by the workers); "
        "0: a thread of the training process.", 2)
    wandb_project: str = _doc("wandb project (logger: wandb); runs offline unless WANDB_API_KEY is set.", "eyas")


@dataclass
class EvalConfig:
    prompts: str = _doc("heldout (the recipe's held-out split), or a JSONL file (MT-bench turns or OpenAI messages).", "heldout")
    max_prompts: int = _doc("Evaluate at most this many prompts (0: all).", 20)
    max_new_tokens: int = _doc("Tokens generated per prompt.", 128)
    answer_tokens: int = _doc(
        "Multi-turn prompts: tokens of the target's greedy answer to turn k that turn k+1 follows.", 128)
    shapes: list = _doc(
        "Draft shapes compared: `chain:K`, `chain:K,confidence=C` (cut where the running product of the draft's "
        "confidences falls below C: a draft with a confidence head, dspark), `tree:<json list of paths>`, "
        "`dynamic:depth=D,topk=K,nodes=N`.",
        factory=lambda: ["chain:5", "dynamic:depth=6,topk=8,nodes=32"],
    )
    temperature: float = _doc("Sampling temperature (0: greedy, exact match with the target).", 0.0)
    top_p: float = _doc("Nucleus sampling, applied to target and draft alike (1: off).", 1.0)
    top_k: int = _doc("Top-k sampling, applied to target and draft alike (0: off).", 0)
    baseline: bool = _doc("Also time the target alone for the speedup column.", True)
    batch_size: int = _doc(
        "Prompts decoded at once: one target forward verifies every row's chain or tree (trees and mtp heads draft "
        "row by row). 1: latency figures, one prompt at a time; more: throughput of a prompt set, speedup over the "
        "target alone batched the same way.", 1)
    checkpoint: str = _doc("Draft checkpoint (empty: the run's best checkpoint).", "")
    drafts: list = _doc(
        "Drafts compared: checkpoint directories, `truncated:N` (the target's first N layers) or `mixture:LAM` "
        "(a test draft of known acceptance); empty: eval.checkpoint.",
        factory=list,
    )
    output: str = _doc("Folder for report.json and acceptance.png (empty: `<run_dir>/eval`).", "")
    engine: str = _doc(
        "builtin (eyas's decoder) or vllm: also export each checkpoint and run it in vLLM on the same prompts "
        "(chain shapes, T=0), both decoders' figures side by side; auto: vllm where it can run (vLLM installed, "
        "T=0, a chain shape, drafts vLLM serves without a plugin), else builtin, with the reason in the report.",
        "builtin"
    )
    target_dtype: str = _doc(
        "Precision the target runs in for eval: auto (target.dtype when set, else bf16 where this machine measured "
        "it exact for a T=0 verify and faster for the target alone, fp32 elsewhere; measured once per machine and "
        "target), fp32 or bf16. Outputs are compared with the same target in the same precision; the speedup is "
        "over the fastest target alone measured.", "auto")


@dataclass
class ExportConfig:
    to: str = _doc("Serving engine format: sglang or vllm.", "sglang")
    checkpoint: str = _doc("Checkpoint to export (empty: the run's best).", "")
    dtype: str = _doc("Exported weights dtype: bfloat16, float16 or float32.", "bfloat16")
    num_speculative_tokens: int = _doc("Draft steps written into the export's config (0: train.ttt_steps).", 0)


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dump: DumpConfig = field(default_factory=DumpConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict:
        """The recipe as YAML holds it: a kind's own keys sit flat in the `draft` section."""
        out = dataclasses.asdict(self)
        out["draft"].update(out["draft"].pop("options"))
        return out


# Values restricted to a set of choices, and numeric ranges: (key -> check, message).
CHOICES = {
    "target.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.regenerate_dtype": ("", "auto", "float32", "bfloat16", "float16"),
    "target.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "data.format": ("auto", "sharegpt", "openai", "text"),
    "data.overflow": ("truncate", "drop"),
    "dump.encoding": ("bf16", "fp16", "fp8", "int8", "int4"),
    "dump.low_layer_encoding": ("", "bf16", "fp16", "fp8", "int8", "int4"),
    "dump.teacher": ("last_hidden", "topk"),
    "dump.backend": ("transformers", "vllm"),
    "draft.kind": KINDS.keys(),  # one line per kind in eyas/draft/registry.py (a live view)
    "train.source": ("shards", "online", "stream"),
    "train.stream_cache": ("auto", "keep", "none"),
    "train.mixed_precision": ("auto", "fp32", "no", "bf16", "fp16"),
    "train.ttt_token_feed": ("auto", "draft", "data"),
    "train.draft_init": ("random", "target_last_layer"),
    "train.logger": ("none", "wandb", "tensorboard"),
    "export.to": ("sglang", "vllm"),
    "eval.engine": ("builtin", "vllm", "auto"),
    "eval.target_dtype": ("auto", "fp32", "bf16"),
    "export.dtype": ("bfloat16", "float16", "float32"),
}
LOSS_NAMES = ("forward_kl", "ce", "tv", "jsd", "lk", "topk", "confidence")
# loss terms that score a part only some heads have: a kind lists those it trains in `KindRules.losses`
HEAD_LOSSES = ("confidence",)

POSITIVE = ["train.stream_window", "train.stream_timeout_s", "train.stream_port", "train.stream_batch",
            "train.lr", "train.token_budget", "train.grad_accum", "train.ttt_steps", "train.teacher_chunk",
            "train.log_every", "draft.num_steps", "data.max_length", "data.num_proc",
            "data.regenerate_max_new_tokens", "data.regenerate_batch_size", "dump.token_budget",
            "dump.shard_tokens", "dump.vllm_tensor_parallel_size",
            "dump.topk", "eval.max_new_tokens", "eval.answer_tokens", "data.self_prompt_temperature", "train.epochs",
            "train.keep_last", "train.eval_batches", "eval.batch_size", "train.dist_timeout_s"]
NON_NEGATIVE = ["train.stream_engines", "train.ttt_ramp_steps", "train.loader_workers", "train.tree_width",
                "train.prefetch", "train.max_steps", "data.max_turns", "train.warmup_steps", "train.weight_decay", "train.max_grad_norm",
                "train.eval_every", "train.save_every", "train.feature_loss_weight", "data.max_samples", "data.self_prompts",
                "data.self_prompt_top_k", "data.regenerate_temperature", "dump.draft_vocab_size", "draft.intermediate_size",
                "eval.max_prompts", "eval.temperature", "eval.top_k", "export.num_speculative_tokens"]
UNIT_INTERVAL = {"data.heldout_fraction": (0.0, 1.0, "closed-open"), "train.min_lr_ratio": (0.0, 1.0, "closed"),
                 "train.ttt_decay": (0.0, 1.0, "open-closed"), "eval.top_p": (0.0, 1.0, "open-closed"),
                 "data.self_prompt_top_p": (0.0, 1.0, "open-closed"),
                 "data.self_prompt_dedup": (0.0, 1.0, "open-closed")}


def section_class(name: str) -> Any:
    """The dataclass of the recipe section `name` (RunConfig for `run`, ...)."""
    return typing.get_type_hints(Recipe)[name]


def suggest(word: str, valid: list[str]) -> str:
    """The end of an error naming a misspelt `word`: the closest of `valid`, else all of them."""
    close = difflib.get_close_matches(word, valid, n=3, cutoff=0.5)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return "valid keys: " + ", ".join(valid)


def _not_text(value: Any) -> str | None:
    """The first string in `value` (or in its nested lists and mappings) that no path, file or tokenizer takes:
    one holding a NUL or a lone surrogate (YAML's "\\ud800" escape). Recursive YAML (`&a [*a]`) is walked once."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item or not _encodes(item):
                return item
        elif isinstance(item, (list, dict)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field's type; ints are accepted for floats, and so is a number in
    exponent form without a dot (`3e-4`): PyYAML reads it as text (YAML 1.1), YAML 1.2 and people as a
    number. Nothing else is coerced."""
    bad = _not_text(value)
    if bad is not None:
        raise EyasError(f"recipe key '{key}' holds {bad!r}, with a NUL or a lone surrogate, which no path, file or "
                        "tokenizer takes; write it as plain UTF-8 text")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    if annotation is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise EyasError(f"recipe key '{key}' must be a list, got {type(value).__name__} {value!r}")
        return value
    ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    if annotation is float and isinstance(value, float) and math.isnan(value):
        ok = False
    if not ok:
        raise EyasError(
            f"recipe key '{key}' must be {annotation.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def build_section(name: str, cls: type, values: Any) -> Any:
    """Recipe section `name` (dataclass `cls`) from its keys as written, each checked against its type."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise EyasError(f"recipe section '{name}' must be a mapping of keys, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in valid:
            raise EyasError(f"unknown recipe key {f'{name}.{key}'!r}: {suggest(str(key), valid)}")
        kwargs[key] = coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)
