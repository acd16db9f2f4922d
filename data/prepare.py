"""`eyas prepare RECIPE`: chat data -> token ids + assistant-only loss masks.

Every conversation is rendered with the target tokenizer's own chat template (the draft
must see exactly what the target sees at serving time) and tokenised; the loss mask is 1
on the tokens the assistant writes (its content and the end-of-turn token), 0 elsewhere.

How the assistant tokens are found:
- templates with `{% generation %}` markers: HF's `return_assistant_tokens_mask`;
- any other template: render the conversation up to each assistant turn with the
  generation prompt, and up to the end of that turn; the characters between the two
  renders (trailing whitespace dropped) are the assistant's. Characters map to tokens
  through the tokenizer's offsets, so the mask never depends on how a prefix tokenises.
  A template that closes the conversation's last turn with its own marker (gpt-oss's harmony
  format: `<|return|>` there, `<|end|>` after every earlier turn) is read the same way, each
  earlier turn taking the marker the full render writes after it;
- templates whose renders are not prefixes of each other (some "thinking" templates
  rewrite earlier turns) fall back to locating each turn's content in the full render.

Before rendering, `data.self_prompts` adds conversations whose user turn the target wrote
(`eyas.data.self_prompts`) and `data.regenerate` rewrites the assistant turns with the target
(`eyas.data.regenerate`).

Rows that cannot be used are counted by reason, printed, and written to
`run_dir/prepared/skipped.json`; nothing is dropped silently. Rows longer than
`data.max_length` that are kept cut (`data.overflow: truncate`) are counted there too
(`truncated`, with examples), apart from the skips. The target must be a causal LM (a
masked LM is refused before any work), and a rerun removes temporary files a killed run left.

Output: `run_dir/prepared/{train,heldout}` (`datasets` save_to_disk) with columns
`id`, `input_ids`, `loss_mask`, `messages`; `load_prepared(run_dir, split)` reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from eyas.config import save_resolved
from eyas.data.regenerate import regenerate_rows
from eyas.data.self_prompts import category_mix, parse_categories, regenerate_unreplied, self_prompt_rows, turn_mix
from eyas.data.sources import Skips, first_turns, load_rows, split_heldout
from eyas.errors import EyasError
from eyas.io import atomic_write_json, fresh_partial, publish_dir, remove_stale_temps
from eyas.precision import regenerate_dtype
from eyas.recipe_schema import Recipe
from eyas.targets import load_target, load_target_config, load_tokenizer, pick_device

SPLITS = ("train", "heldout")
# Skip reasons (stable strings: they are the keys of skipped.json)
EMPTY = "empty conversation"
NO_ASSISTANT = "no assistant turn"
TEMPLATE_ERROR = "template rejected the conversation"
TOO_LONG = "longer than max_length"
NOTHING_LEFT = "no assistant tokens within max_length"
TOKENIZED_SCHEMA = 2  # columns of the tokenised cache (2: + truncated); part of its file name


# ----------------------------------------------------------------------------- rendering


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    fast = _fast_renderer(tokenizer)
    if fast is not None:
        return fast(messages, add_generation_prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


_RENDERERS: dict = {}


def _fast_renderer(tokenizer: Any):
    """The compiled template rendered directly (10x less overhead than apply_chat_template, which
    re-validates every message on each call; the mask needs two renders per assistant turn).
    Used only after it reproduced apply_chat_template exactly on a probe conversation."""
    key = (id(tokenizer), tokenizer.chat_template, str(sorted(tokenizer.special_tokens_map.items())))
    if key in _RENDERERS:
        return _RENDERERS[key]
    renderer = None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(tokenizer.chat_template)
        specials = dict(tokenizer.special_tokens_map)

        def renderer(messages: list[dict], add_generation_prompt: bool) -> str:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                   documents=None, **specials)

        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": " u "},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        for gen in (True, False):
            if renderer(probe, gen) != tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=gen):
                renderer = None
                break
    except Exception:  # a private transformers helper that moved, or a template that rejects the probe
        renderer = None
    _RENDERERS[key] = renderer
    return renderer


def has_generation_markers(template: str | None) -> bool:
    """True when the template marks assistant text with `{% generation %}` blocks."""
    import re

    return bool(template) and re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def _prefix_spans(tokenizer: Any, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
    """Character spans of assistant turns from prefix renders; None if renders aren't prefixes."""
    spans, markers = [], None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if text.startswith(through):
            end = len(through.rstrip())
        else:  # a template may close the conversation's last turn differently (gpt-oss: <|return|>, not <|end|>)
            markers = markers or _end_markers(tokenizer)
            end = _history_end(text, through.rstrip(), markers)
        if not text.startswith(before) or end is None or len(through) < len(before):
            return None
        start = len(before)
        if i == 0:  # no generation prompt to subtract: the turn starts where its content starts
            found = through.find(message["content"].strip())
            start = found if found >= 0 else end
        spans.append((start, max(start, end)))
    return spans


def _history_end(text: str, through: str, markers: tuple[str, str]) -> int | None:
    """Where a turn that `through` renders as the last one ends in `text`, which continues past it: `through`
    with its closing marker swapped for the one the template writes after an earlier turn; None if it differs
    in more than that (a template that rewrites the turn)."""
    last, history = markers
    if not (last and history and through.endswith(last)):
        return None
    body = through[: len(through) - len(last)]
    return len(body) + len(history) if text.startswith(body + history) else None


def _end_markers(tokenizer: Any) -> tuple[str, str]:
    """The text a template writes after an assistant's content when the turn is the conversation's last
    (e.g. `<|im_end|>`; gpt-oss's harmony format: `<|return|>`) and when another turn follows (the same, or
    the added token the template writes there instead: harmony's `<|end|>`)."""
    answer = "probe-answer"
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": answer}]
    last = _render(tokenizer, probe, add_generation_prompt=False)
    history = _render(tokenizer, probe + [{"role": "user", "content": "v"}], add_generation_prompt=False)
    last_end = last[last.rfind(answer) + len(answer):].rstrip() if answer in last else ""
    after = history[history.find(answer) + len(answer):] if answer in history else ""
    if after.startswith(last_end):
        return last_end, last_end
    added = [token for token in tokenizer.get_added_vocab() if token and after.startswith(token)]
    return last_end, max(added, key=len, default="")


def _search_spans(tokenizer: Any, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Fallback: find each assistant content in order in the full render."""
    markers = _end_markers(tokenizer)
    spans, cursor = [], 0
    for message in messages:
        content = message["content"].strip()
        if message["role"] != "assistant" or not content:
            continue
        at = text.find(content, cursor)
        if at < 0 and "</think>" in content:  # thinking templates drop earlier turns' thoughts
            content = content.split("</think>")[-1].strip()
            at = text.find(content, cursor) if content else -1
        if at < 0:
            continue  # the template dropped or rewrote this turn beyond recognition
        end = at + len(content)
        end += next((len(marker) for marker in markers if marker and text.startswith(marker, end)), 0)
        spans.append((at, end))
        cursor = end
    return spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap an assistant span."""
    mask = [0] * len(offsets)
    span_i = 0
    for t, (s, e) in enumerate(offsets):
        while span_i < len(spans) and spans[span_i][1] <= s:
            span_i += 1
        if span_i < len(spans) and s < spans[span_i][1] and e > spans[span_i][0]:
            mask[t] = 1
    return mask


def tokenize_conversation(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation under the tokenizer's chat template."""
    if has_generation_markers(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = _prefix_spans(tokenizer, messages, text)
    if spans is None:
        spans = _search_spans(tokenizer, messages, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)


def tokenize_text(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Plain text rows: the tokenizer's own special tokens, loss on every token."""
    ids = list(tokenizer(text)["input_ids"])
    return ids, [1] * len(ids)


# ----------------------------------------------------------------------------- one row


def normalise_messages(messages: list[dict], system_prompt: str) -> list[dict]:
    """Drop empty turns and turns after the last assistant turn; add the default system prompt."""
    kept = [{"role": m["role"], "content": m["content"]} for m in messages if m["content"].strip()]
    last_assistant = max((i for i, m in enumerate(kept) if m["role"] == "assistant"), default=-1)
    kept = kept[: last_assistant + 1] if last_assistant >= 0 else kept
    if system_prompt and kept and kept[0]["role"] != "system":
        kept.insert(0, {"role": "system", "content": system_prompt})
    return kept


def fit_length(ids: list[int], mask: list[int], max_length: int, overflow: str) -> tuple[list, list, str]:
    """Apply the max_length policy; returns (ids, mask, skip reason or '')."""
    if len(ids) > max_length:
        if overflow == "drop":
            return ids, mask, TOO_LONG
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return ids, mask, NOTHING_LEFT
    return ids, mask, ""


def prepare_row(row: dict, tokenizer: Any, max_length: int, overflow: str, system_prompt: str) -> dict:
    """One row -> {id, input_ids, loss_mask, messages, skip, detail}; never raises for bad data."""
    out = {"id": row["id"], "input_ids": [], "loss_mask": [], "messages": [], "skip": "", "detail": "",
           "truncated": False}
    if row.get("text"):
        ids, mask = tokenize_text(tokenizer, row["text"])
    else:
        messages = normalise_messages(row.get("messages") or [], system_prompt)
        out["messages"] = messages
        if not any(m["role"] != "system" for m in messages):
            out["skip"] = EMPTY
            return out
        if not any(m["role"] == "assistant" for m in messages):
            out["skip"] = NO_ASSISTANT
            return out
        try:
            ids, mask = tokenize_conversation(tokenizer, messages)
        except Exception as exc:  # jinja's raise_exception, undefined fields, ...: the template's verdict
            out["skip"], out["detail"] = TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}"
            return out
    full_length = len(ids)
    ids, mask, reason = fit_length(ids, mask, max_length, overflow)
    truncated = not reason and full_length > len(ids)
    detail = f"{len(ids)} tokens" if reason else f"{full_length} tokens, cut to {len(ids)}" if truncated else ""
    out.update(input_ids=ids, loss_mask=mask, skip=reason, detail=detail, truncated=truncated)
    return out


def _prepare_batch(batch: dict, tokenizer: Any, max_length: int, overflow: str, system_prompt: str) -> dict:
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    results = [prepare_row(r, tokenizer, max_length, overflow, system_prompt) for r in rows]
    return {key: [r[key] for r in results] for key in results[0]}


# ----------------------------------------------------------------------------- datasets


def _features():
    from datasets import Features, Sequence, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features({
        "id": Value("string"), "input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
        "messages": [message], "skip": Value("string"), "detail": Value("string"), "truncated": Value("bool"),
    })


def _fingerprint(rows: list[dict], tokenizer: Any, settings: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(dict(settings, schema=TOKENIZED_SCHEMA), sort_keys=True).encode())
    h.update((tokenizer.chat_template or "").encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for row in rows:
        h.update(json.dumps(row, sort_keys=True).encode())
    return h.hexdigest()[:20]


def tokenize_rows(rows: list[dict], tokenizer: Any, data_cfg: Any, cache_dir: Path | None = None):
    """Rows -> a Dataset with input_ids/loss_mask (+ skip/detail columns), via datasets.map."""
    from datasets import Dataset

    uniform = [{"id": r["id"], "text": r.get("text", ""), "messages": r.get("messages", [])} for r in rows]
    ds = Dataset.from_list(uniform)
    settings = {"max_length": data_cfg.max_length, "overflow": data_cfg.overflow, "system_prompt": data_cfg.system_prompt}
    cache_file = None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache_file = str(cache_dir / f"tokenized-{_fingerprint(uniform, tokenizer, settings)}.arrow")
    return ds.map(
        _prepare_batch, batched=True, batch_size=256, num_proc=data_cfg.num_proc if len(ds) > 1 else None,
        fn_kwargs=dict(tokenizer=tokenizer, **settings), remove_columns=ds.column_names,
        features=_features(), cache_file_name=cache_file, load_from_cache_file=cache_file is not None,
        desc="tokenising",
    )


def count_skips(ds, skips: Skips, split: str):
    """Move skipped rows out of `ds` into `skips` (with the split name in the example); count the
    kept rows that were cut to max_length."""
    reasons = ds["skip"]
    skipped = [i for i, r in enumerate(reasons) if r]
    if skipped:
        sub = ds.select(skipped).select_columns(["id", "skip", "detail"])
        for row in sub:
            skips.add(row["skip"], row["id"], f"{split}: {row['detail']}".rstrip(": "))
    cut = [i for i, t in enumerate(ds["truncated"]) if t]
    if cut:
        for row in ds.select(cut).select_columns(["id", "detail"]):
            skips.add_truncated(row["id"], f"{split}: {row['detail']}")
    kept = ds.filter(lambda r: not r, input_columns=["skip"]) if skipped else ds
    return kept.remove_columns(["skip", "detail", "truncated"])


def _save_dataset(ds, out: Path) -> None:
    """save_to_disk into a temporary folder, then swap it in: a killed prepare leaves no half split."""
    tmp = fresh_partial(out)
    ds.save_to_disk(str(tmp), num_shards=1 if len(ds) == 0 else None)  # an empty split still gets a file
    publish_dir(tmp, out)


def write_skips(skips: Skips, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"total": skips.total, "counts": dict(skips.counts.most_common()), "examples": skips.examples,
               "truncated": skips.truncated, "truncated_examples": skips.truncated_examples}
    atomic_write_json(path, payload)


def tokenizer_identity(tokenizer: Any) -> str:
    """Hash of vocabulary + chat template: dump refuses prepared data from another tokenizer."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


def load_prepared(run_dir: str | Path, split: str = "train"):
    """The prepared split as a `datasets.Dataset` (columns id, input_ids, loss_mask, messages)."""
    from datasets import load_from_disk

    if split not in SPLITS:
        raise EyasError(f"unknown prepared split '{split}'; choose one of: {', '.join(SPLITS)}")
    path = Path(run_dir) / "prepared" / split
    if not (path / "dataset_info.json").is_file():
        raise EyasError(f"no prepared data at '{path}'; run `eyas prepare RECIPE` first")
    return load_from_disk(str(path))


def prepared_info(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "prepared" / "info.json"
    if not path.is_file():
        raise EyasError(f"'{path}' is missing; run `eyas prepare RECIPE` first")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- the stage


def prepare(recipe: Recipe, tokenizer: Any = None, model: Any = None) -> dict:
    """Run the whole stage for a recipe; returns the info dict written to prepared/info.json."""
    out_dir = recipe.run_dir / "prepared"
    parse_categories(recipe.data.self_prompt_categories)  # a bad category is refused before any work
    if model is None:  # a masked LM or untrusted custom code is refused before any work
        load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
    remove_stale_temps(out_dir)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(recipe.target)
    if not getattr(tokenizer, "is_fast", False):
        raise EyasError("prepare needs a fast tokenizer (offset mappings); the target's tokenizer is a slow one")
    if recipe.data.source == "none":
        rows, skips = [], Skips()
    else:
        rows, skips = load_rows(recipe.data.source, recipe.data.format, recipe.data.max_samples)
    rows = first_turns(rows, recipe.data.max_turns)
    if recipe.data.regenerate and model is None and not recipe.data.regenerate_endpoint:
        dtype = regenerate_dtype(recipe.data.regenerate_dtype, recipe.target.dtype, pick_device(recipe.target.device))
        model, _ = load_target(dataclasses.replace(recipe.target, dtype=dtype))  # once, for every use below
    written = []
    if recipe.data.self_prompts:
        written = self_prompt_rows(recipe, model, tokenizer, skips)
    rows += written
    train_rows, heldout_rows = split_heldout(rows, recipe.data.heldout_fraction, recipe.run.seed)
    if recipe.data.regenerate:
        # two-turn self-conversations are answered already
        train_rows = regenerate_unreplied(train_rows, lambda r: regenerate_rows(r, recipe, tokenizer, model=model))
        heldout_rows = regenerate_unreplied(heldout_rows, lambda r: regenerate_rows(r, recipe, tokenizer, model=model))
    info = {"source": recipe.data.source, "tokenizer_identity": tokenizer_identity(tokenizer),
            "target_path": recipe.target.path, "regenerated": bool(recipe.data.regenerate),
            "self_prompts": len(written), "splits": {}}
    if written:
        info["self_prompt_categories"], info["self_prompt_turns"] = category_mix(written), turn_mix(written)
    for split, split_rows in (("train", train_rows), ("heldout", heldout_rows)):
        if not split_rows:
            ds = tokenize_rows([{"id": "_", "messages": []}], tokenizer, recipe.data).select([])
        else:
            ds = tokenize_rows(split_rows, tokenizer, recipe.data, cache_dir=out_dir / ".cache")
        ds = count_skips(ds, skips, split)
        _save_dataset(ds, out_dir / split)
        info["splits"][split] = split_stats(ds)
    info["skipped"] = dict(skips.counts.most_common())
    info["truncated"] = skips.truncated
    write_skips(skips, out_dir / "skipped.json")
    atomic_write_json(out_dir / "info.json", info)
    save_resolved(recipe, out_dir)
    return info


def split_stats(ds: Any) -> dict:
    """Samples, tokens and loss-masked tokens of a prepared split (the figures in info.json)."""
    if not len(ds):
        return {"samples": 0, "tokens": 0, "loss_tokens": 0}
    return {"samples": len(ds), "tokens": sum(len(x) for x in ds["input_ids"]),
            "loss_tokens": sum(sum(m) for m in ds["loss_mask"])}


def _report(info: dict, out_dir: Path) -> None:
    for split, s in info["splits"].items():
        print(f"eyas prepare: {split}: {s['samples']} samples, {s['tokens']} tokens ({s['loss_tokens']} under the loss mask)")
    if info.get("self_prompts"):
        mix = ", ".join(f"{k} {v}" for k, v in info.get("self_prompt_categories", {}).items())
        turns = ", ".join(f"{v} with {k} user turn{'s' if k != '1' else ''}"
                          for k, v in info.get("self_prompt_turns", {}).items())
        print(f"eyas prepare: {info['self_prompts']} target-written conversations ({turns})"
              + (f"; categories: {mix}" if mix else ""))
    skipped = info["skipped"]
    if skipped:
        listed = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
        print(f"eyas prepare: skipped {sum(skipped.values())} rows: {listed} (listed in {out_dir / 'skipped.json'})")
    else:
        print("eyas prepare: no rows skipped")
    if info.get("truncated"):
        print(f"eyas prepare: cut {info['truncated']} rows longer than data.max_length to their first tokens "
              f"(data.overflow: truncate; listed in {out_dir / 'skipped.json'})")
    print(f"eyas prepare: wrote {out_dir}")


def main(argv: list[str] | None = None) -> int:
    # command line only: the stage's library functions do not need the CLI helpers
    from eyas import stages
    from eyas.stage_cli import stage_main  # likewise

    def body(recipe: Any, args: Any) -> None:
        stages.run("prepare", recipe, lambda: _report(prepare(recipe), recipe.run_dir / "prepared"),
                   force=args.force)

    return stage_main("prepare", argv, body)


if __name__ == "__main__":
    sys.exit(main())
