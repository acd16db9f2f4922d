"""Run several drafts x shapes over the same prompts, interleaved with the target alone.

For each prompt: the target alone (a bare KV-cache loop, `target_decode`) is timed first, then
every configuration decodes the same prompt; interleaving keeps slow drifts of a shared
machine from favouring whichever ran first. A short untimed warm-up runs each path once.
At T=0 every speculative output is also compared with the target's own greedy output.

With `batch_size` > 1 the prompts go in batches of that many (in the given order): the target
alone decodes a batch with `plain_decode` (left-padded, finished rows leave), and each
configuration decodes it with `eyas.eval.batched.BatchedDecoder` (one target forward verifies
every row; trees and mtp heads draft each row with its own copy of the draft); the mixture test
draft decodes the batch one prompt at a time, and its summary says why (`batch_note`). A batch's seconds are split evenly over its rows, so
tokens/s, prompts/s and the speedup are the batch's throughput; at batch 1 they are the
latency figures of one prompt at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from eyas.decode import SamplingParams, stop_token_ids
from eyas.eval.batched import BatchedDecoder, batch_unsupported
from eyas.eval.decoder import SpeculativeDecoder, max_context, target_decode, target_decode_batch
from eyas.eval.metrics import BaselineTally, Tally, summarize
from eyas.eval.prompts import Prompt, next_turn, render
from eyas.shapes import Shape


@dataclass
class EncodedPrompt:
    prompt: Prompt
    ids: list[int]

    @property
    def turn(self) -> int:
        return self.prompt.turn


@dataclass
class Config:
    draft: object
    shape: Shape
    decoder: SpeculativeDecoder
    batched: BatchedDecoder | None = None
    batch_note: str | None = None
    overall: Tally = field(default_factory=Tally)
    per_category: dict = field(default_factory=dict)
    per_turn: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.draft.name} {self.shape.spec}"


def encode_prompts(prompts: list[Prompt], tokenizer, target, max_new_tokens: int, max_nodes: int,
                   answer_tokens: int = 128) -> tuple[list[EncodedPrompt], dict[str, int]]:
    """Render prompts, every turn of a multi-turn one; those that cannot fit prompt + generation +
    one verify tree are skipped and counted (with the later turns of their conversation).

    Turn k > 1 follows the target's own greedy answer (up to `answer_tokens` tokens) to turn k-1,
    so the draft is measured on the context it meets in a conversation, whatever the eval's
    sampling settings.
    """
    limit = max_context(target)
    kept, skipped = [], {}
    eos = stop_token_ids(target, tokenizer)
    pending = list(prompts)
    while pending:
        prompt = pending.pop(0)
        ids = render(prompt, tokenizer)
        if len(ids) + max(max_new_tokens, answer_tokens if prompt.followups else 0) + max_nodes + 1 > limit:
            reason = f"longer than the context ({limit} tokens) with {max_new_tokens} new tokens"
            skipped[reason] = skipped.get(reason, 0) + 1 + len(prompt.followups)
            continue
        kept.append(EncodedPrompt(prompt, ids))
        if prompt.followups:
            answer = target_decode(target, ids, answer_tokens, SamplingParams(), eos)
            text = tokenizer.decode([t for t in answer if t not in eos], skip_special_tokens=True).strip()
            pending.append(next_turn(prompt, text))
    return kept, skipped


def _clock(device) -> float:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def evaluate(target, tokenizer, drafts: list, shapes: list[Shape], prompts: list[EncodedPrompt],
             params: SamplingParams, max_new_tokens: int, seed: int = 0, baseline: bool = True,
             progress: bool = True, batch_size: int = 1, baseline_target=None,
             references: list[list[int]] | None = None) -> dict:
    """Decode every prompt with every draft x shape (and the target alone); return summaries.

    `references`: the target's greedy output for each prompt where the caller has decoded it already
    (several evaluations of the same prompts): each T=0 decode is checked against it instead of
    against a baseline decoded here, so `baseline` may be False and the target alone is not decoded again.

    `baseline_target`: the same target in the precision the target alone is fastest in, where that is
    not `target`'s (eval.target_precision): the baseline is timed in it, and the `=greedy` reference
    is decoded (untimed) by `target`, in the precision the speculative decodes run in."""
    eos = stop_token_ids(target, tokenizer)
    configs = [Config(d, s, SpeculativeDecoder(target, d, s, params, eos, seed=seed)) for d in drafts for s in shapes]
    timed = baseline_target if baseline_target is not None else target
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"{len(references)} references for {len(prompts)} prompts")
    if batch_size > 1:
        return _evaluate_batched(target, timed, configs, prompts, params, max_new_tokens, eos, seed, baseline,
                                 progress, batch_size, references)
    base_all, base_cat, base_turn = BaselineTally(), {}, {}
    if prompts:  # untimed warm-up of every path (first-call allocations, kernel selection)
        target_decode(timed, prompts[0].ids, min(8, max_new_tokens), params, eos, seed)
        for config in configs:
            config.decoder.generate(prompts[0].ids, min(8, max_new_tokens))
    total = len(prompts) * (len(configs) + int(baseline))
    bar = tqdm(total=total, desc="eval", unit="decode", disable=not progress, dynamic_ncols=True)
    for index, item in enumerate(prompts):
        category = item.prompt.category
        reference = references[index] if references is not None else None
        if baseline:
            start = _clock(timed.device)
            alone = target_decode(timed, item.ids, max_new_tokens, params, eos, seed + index)
            seconds = _clock(timed.device) - start
            base_all.add(len(alone), seconds)
            base_cat.setdefault(category, BaselineTally()).add(len(alone), seconds)
            base_turn.setdefault(item.turn, BaselineTally()).add(len(alone), seconds)
            same = timed is target or not params.greedy  # else the reference in the decodes' precision
            if reference is None:
                reference = alone if same else target_decode(target, item.ids, max_new_tokens, params, eos, seed + index)
            bar.update(1)
        for config in configs:
            result = config.decoder.generate(item.ids, max_new_tokens)
            ref = reference if (params.greedy and reference is not None) else None
            config.overall.add(result, ref)
            config.per_category.setdefault(category, Tally()).add(result, ref)
            config.per_turn.setdefault(item.turn, Tally()).add(result, ref)
            bar.update(1)
        if configs:
            bar.set_postfix(tau=f"{1 + configs[0].overall.accepted / max(configs[0].overall.rounds, 1):.2f}")
    bar.close()
    return _summaries(configs, baseline, base_all, base_cat, base_turn, timed)


def _summaries(configs: list[Config], baseline: bool, base_all: BaselineTally, base_cat: dict, base_turn: dict,
               timed) -> dict:
    return {
        "baseline": {**_baseline_summary(base_all, base_cat, base_turn), "dtype": _dtype_name(timed)} if baseline else None,
        "configs": [_config_summary(c, base_all if baseline else None, base_cat, base_turn) for c in configs],
    }


def _evaluate_batched(target, timed, configs: list[Config], prompts: list[EncodedPrompt], params: SamplingParams,
                      max_new_tokens: int, eos: list[int], seed: int, baseline: bool, progress: bool,
                      batch_size: int, given: list[list[int]] | None) -> dict:
    """`evaluate` over batches of `batch_size` prompts (see the module docstring)."""
    for config in configs:
        config.batch_note = batch_unsupported(config.draft)
        if config.batch_note is None:
            config.batched = BatchedDecoder(target, config.draft, config.shape, params, eos)
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    base_all, base_cat, base_turn = BaselineTally(), {}, {}
    if batches:  # untimed warm-up of every path on two rows (first-call allocations; a full batch costs minutes)
        first = [prompts[i].ids for i in batches[0][:2]]
        target_decode_batch(timed, first, min(8, max_new_tokens), params, eos, seed)
        for config in configs:
            _decode_batch(config, first, min(8, max_new_tokens), [seed + i for i in batches[0][:2]])
    bar = tqdm(total=len(prompts) * (len(configs) + int(baseline)), desc="eval", unit="decode",
               disable=not progress, dynamic_ncols=True)
    for batch in batches:
        rows = [prompts[i].ids for i in batch]
        references = [given[i] for i in batch] if given is not None else [None] * len(batch)
        if baseline:
            start = _clock(timed.device)
            alone = target_decode_batch(timed, rows, max_new_tokens, params, eos, seed + batch[0])
            share = (_clock(timed.device) - start) / len(batch)
            same = timed is target or not params.greedy  # else the references in the decodes' precision
            if given is None:
                references = alone if same else target_decode_batch(target, rows, max_new_tokens, params, eos,
                                                                     seed + batch[0])
            for i, tokens in zip(batch, alone):
                item = prompts[i]
                for tally in (base_all, base_cat.setdefault(item.prompt.category, BaselineTally()),
                              base_turn.setdefault(item.turn, BaselineTally())):
                    tally.add(len(tokens), share)
            bar.update(len(batch))
        for config in configs:
            results = _decode_batch(config, rows, max_new_tokens, [seed + i for i in batch])
            for i, result, reference in zip(batch, results, references):
                ref = reference if params.greedy else None
                item = prompts[i]
                config.overall.add(result, ref)
                config.per_category.setdefault(item.prompt.category, Tally()).add(result, ref)
                config.per_turn.setdefault(item.turn, Tally()).add(result, ref)
            bar.update(len(batch))
        if configs:
            bar.set_postfix(tau=f"{1 + configs[0].overall.accepted / max(configs[0].overall.rounds, 1):.2f}")
    bar.close()
    return _summaries(configs, baseline, base_all, base_cat, base_turn, timed)


def _dtype_name(model) -> str:
    return str(model.dtype).replace("torch.", "")


def _decode_batch(config: Config, rows: list[list[int]], max_new_tokens: int, seeds: list[int]) -> list:
    """The batched decoder where the draft x shape has one, else one prompt at a time."""
    if config.batched is not None:
        return config.batched.generate(rows, max_new_tokens, seeds)
    return [config.decoder.generate(row, max_new_tokens) for row in rows]


def _baseline_summary(overall: BaselineTally, per_category: dict, per_turn: dict) -> dict:
    def one(t: BaselineTally) -> dict:
        return {"prompts": t.prompts, "tokens": t.tokens, "seconds": t.seconds, "tokens_per_s": t.tokens_per_s,
            "prompts_per_s": t.prompts / t.seconds if t.seconds > 0 else 0.0}

    return {"overall": one(overall), "per_category": {k: one(v) for k, v in sorted(per_category.items())},
            "per_turn": {str(k): one(v) for k, v in sorted(per_turn.items())}}


def _config_summary(config: Config, baseline: BaselineTally | None, base_cat: dict, base_turn: dict) -> dict:
    # a confidence-cut chain varies its length: no fixed-K figures (tau_iid) for it
    depth, chain = config.shape.depth, config.shape.kind == "chain" and not config.shape.confidence
    return {
        "draft": config.draft.name,
        "shape": config.shape.spec,
        "label": config.label,
        "batched": config.batched is not None,
        "batch_note": config.batch_note,
        "overall": {**summarize(config.overall, depth, chain, baseline), "prompts_per_s": _per_s(config.overall)},
        "per_category": {
            cat: summarize(t, depth, chain, base_cat.get(cat) if baseline else None)
            for cat, t in sorted(config.per_category.items())
        },
        "per_turn": {
            str(turn): summarize(t, depth, chain, base_turn.get(turn) if baseline else None)
            for turn, t in sorted(config.per_turn.items())
        },
    }


def _per_s(tally: Tally) -> float:
    return tally.prompts / tally.total_s if tally.total_s > 0 else 0.0
