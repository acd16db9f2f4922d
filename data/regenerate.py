"""Regeneration: replace each assistant turn with the target's own response.

A draft learns to predict the target; training it on another author's answers teaches it a
distribution the target never produces. With `data.regenerate: true`, prepare asks the target
for every assistant turn in order, given the conversation so far (earlier turns already
regenerated), and keeps the user turns as they are. A conversation that ends on a user turn
gets the target's reply appended, so prompt-only rows become training data. With
`data.max_turns: N` prepare has already cut each conversation after its N-th exchange, which
spends the generation budget on more conversations instead of longer ones (and drops later
user turns that answered replies the target did not write).

Two back ends:
- the target itself through HF `generate`, batched with left padding (conversations are grouped
  by turn number and sorted by prompt length so a batch wastes little padding);
- an OpenAI-compatible server (`data.regenerate_endpoint`, e.g. vLLM or SGLang serving a large
  target), with `regenerate_batch_size` requests in flight; standard library only.
Greedy at temperature 0, sampling otherwise (seeded by run.seed for the built-in loop).
Turns whose prompt already fills `data.max_length` are left as they are: prepare would cut them.

Every reply is appended to a reply cache (`<run_dir>/regen_cache.jsonl`, or
`data.regenerate_cache`) as soon as its batch ends, keyed by the prompt and everything that
decides the reply (the target's identity and dtype or the endpoint's model, max_new_tokens,
temperature, seed). An interrupted prepare run again asks the target only for the replies it
lacks, so a long generation resumes; a cache file carried to another machine resumes there.
At temperature 0 the replies equal an uninterrupted run's; above 0 the rerun's new replies are
fresh samples (the built-in loop's random stream depends on the batch).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eyas.decode import SamplingParams, left_padded, plain_decode, seeded_generator, stop_token_ids, token_chooser
from eyas.errors import EyasError
from eyas.recipe_schema import Recipe
from eyas.targets import load_target, target_identity


def with_reply_slots(rows: list[dict]) -> list[dict]:
    """Copies of the rows in which a conversation ending on a user turn gets an empty assistant
    turn for the target to fill."""
    out = []
    for row in rows:
        messages = [dict(m) for m in row.get("messages") or []]
        if messages and messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": ""})
        out.append(dict(row, messages=messages) if messages else dict(row))
    return out


def _turn_slots(rows: list[dict]) -> list[list[tuple[int, int]]]:
    """slots[r] = (row, message index) of every conversation's r-th assistant turn."""
    slots: list[list[tuple[int, int]]] = []
    for row_i, row in enumerate(rows):
        turn = 0
        for msg_i, message in enumerate(row.get("messages") or []):
            if message["role"] == "assistant":
                if len(slots) <= turn:
                    slots.append([])
                slots[turn].append((row_i, msg_i))
                turn += 1
    return slots


class ReplyCache:
    """Replies already generated, one JSON line each (`{"key": ..., "reply": ...}`; a reply is text, or any
    JSON value a generator keeps), appended per batch.

    `settings`: what decides a reply besides its prompt; a line written under other settings has
    another key and is never used. A torn last line (a kill mid-write) is ignored on load.
    """

    def __init__(self, path: Path | None, settings: dict) -> None:
        self.path = path
        self.settings = json.dumps(settings, sort_keys=True, default=str)
        self.replies: dict[str, Any] = {}
        self.reused = 0
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    self.replies[entry["key"]] = entry["reply"]
                except (ValueError, KeyError, TypeError):
                    continue

    def key(self, prompt: Any) -> str:
        """`prompt`: what was asked, any JSON value (a message list; a continued text and its occurrence)."""
        return hashlib.sha256((self.settings + json.dumps(prompt, sort_keys=True)).encode()).hexdigest()[:32]

    def get(self, prompt: Any) -> Any:
        reply = self.replies.get(self.key(prompt))
        self.reused += reply is not None
        return reply

    def add(self, pairs: list[tuple[Any, Any]]) -> None:
        """Remember replies and append them durably (fsync), so a kill loses at most the batch under way."""
        lines = []
        for prompt, reply in pairs:
            key = self.key(prompt)
            self.replies[key] = reply
            lines.append(json.dumps({"key": key, "reply": reply}, ensure_ascii=False))
        if self.path is None or not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())


def regenerate_conversations(rows: list[dict], generate: Callable[[list[list[dict]]], list[str]],
                             prompt_tokens: Callable[[list[dict]], int], max_length: int,
                             batch_size: int, progress: Any = None, cache: ReplyCache | None = None
                             ) -> tuple[list[dict], Counter]:
    """Replace assistant turns in order; `generate` maps a batch of prompts (message lists) to replies.

    Returns new rows (see `with_reply_slots`) and counts by outcome; `progress` (tqdm) counts turns.
    Replies found in `cache` are used without asking `generate`; new ones are added to it.
    """
    cache = cache or ReplyCache(None, {})
    rows = with_reply_slots(rows)
    turn_slots = _turn_slots(rows)
    if progress is not None:
        progress.reset(total=sum(len(s) for s in turn_slots))
    stats: Counter = Counter()
    stopped: set[int] = set()  # conversations whose prompt already reached max_length
    for slots in turn_slots:
        jobs = []
        for row_i, msg_i in slots:
            if row_i in stopped:
                stats["kept: prompt beyond max_length"] += 1
                continue
            prompt = rows[row_i]["messages"][:msg_i]
            length = prompt_tokens(prompt)
            if length >= max_length:
                stopped.add(row_i)
                stats["kept: prompt beyond max_length"] += 1
                continue
            jobs.append((length, row_i, msg_i))
        jobs.sort(key=lambda j: (-j[0], j[1]))  # similar lengths together: little padding
        todo = []
        for job in jobs:
            _, row_i, msg_i = job
            reply = cache.get(rows[row_i]["messages"][:msg_i])
            if reply is None:
                todo.append(job)
            else:
                _set_reply(rows, row_i, msg_i, reply, stats)
        if progress is not None and len(todo) < len(jobs):
            progress.update(len(jobs) - len(todo))
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            prompts = [rows[r]["messages"][:m] for _, r, m in batch]
            replies = generate(prompts)
            for (_, row_i, msg_i), reply in zip(batch, replies):
                if reply is None:
                    stats["kept: endpoint error"] += 1
                    continue
                _set_reply(rows, row_i, msg_i, reply, stats)
            cache.add([(p, r) for p, r in zip(prompts, replies) if r is not None])
            if progress is not None:
                progress.update(len(batch))
    return rows, stats


def _set_reply(rows: list[dict], row_i: int, msg_i: int, reply: str, stats: Counter) -> None:
    rows[row_i]["messages"][msg_i]["content"] = reply
    stats["regenerated"] += 1
    stats["empty reply"] += 0 if reply.strip() else 1


# ----------------------------------------------------------------------------- the target itself


def hf_generator(model: Any, tokenizer: Any, max_new_tokens: int, temperature: float, seed: int):
    """A `generate(prompts) -> replies` function running the target over left-padded batches
    (`eyas.decode.plain_decode`: finished rows leave the batch, about twice as fast as HF
    `generate` on 2 CPU cores for chitchat replies)."""
    device = next(model.parameters()).device
    eos = set(stop_token_ids(model, tokenizer))
    eos_ids = torch.tensor(sorted(eos), device=device)
    choose = token_chooser(SamplingParams(max(0.0, temperature)), seeded_generator(device, seed))

    def generate(prompts: list[list[dict]]) -> list[str]:
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        enc = left_padded(tokenizer, texts, device)
        new = plain_decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens, eos_ids, choose)
        new = [seq[:-1] if seq and seq[-1] in eos else seq for seq in new]  # the reply, without its EOS
        return [tokenizer.decode(seq, skip_special_tokens=True).strip() for seq in new]

    return generate


# ----------------------------------------------------------------------------- an endpoint


def base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _request(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if payload is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read())


def endpoint_model(endpoint: str, model: str = "") -> str:
    """The model name to request: the recipe's, else the first the server lists."""
    if model:
        return model
    url = base_url(endpoint) + "/models"
    try:
        listed = _request(url, timeout=30)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise EyasError(f"cannot reach data.regenerate_endpoint '{endpoint}' ({exc}); start the server or fix the URL") from None
    if not listed.get("data"):
        raise EyasError(f"'{url}' lists no models; set data.regenerate_model")
    return listed["data"][0]["id"]


def post_choice(url: str, payload: dict, retries: int = 3) -> dict | None:
    """The first choice of an OpenAI-style answer to `payload`, retried on server errors; None when the
    request itself is refused (4xx other than 429) or keeps failing."""
    for attempt in range(retries):
        if attempt:
            time.sleep(0.5 * 2 ** (attempt - 1))  # back off between tries
        try:
            return _request(url, payload)["choices"][0]
        except urllib.error.HTTPError as exc:
            if exc.code < 500 and exc.code != 429:  # the request itself is wrong: retrying won't help
                return None
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
            continue  # a dropped connection or a malformed answer: worth another try
    return None


def endpoint_generator(endpoint: str, model: str, max_new_tokens: int, temperature: float, workers: int,
                       retries: int = 3):
    """`generate(prompts) -> replies` against /v1/chat/completions; None for a request that kept failing."""
    url = base_url(endpoint) + "/chat/completions"

    def one(messages: list[dict]) -> str | None:
        payload = {"model": model, "messages": messages, "max_tokens": max_new_tokens, "temperature": temperature}
        choice = post_choice(url, payload, retries)
        if choice is None:
            return None
        try:
            return ((choice.get("message") or {}).get("content") or "").strip()
        except AttributeError:  # a malformed answer: counted as an endpoint error
            return None

    def generate(prompts: list[list[dict]]) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(one, prompts))

    return generate


# ----------------------------------------------------------------------------- the step


def reply_cache_path(recipe: Recipe) -> Path:
    return Path(recipe.data.regenerate_cache) if recipe.data.regenerate_cache else recipe.run_dir / "regen_cache.jsonl"


def cached(generate: Callable[[list[Any]], list[Any]], cache: ReplyCache):
    """`generate` that answers from `cache` first and adds what it had to generate (not a None: a failure).
    Prompts are any JSON values: message lists for replies, continued texts for target-written turns."""

    def run(prompts: list[Any]) -> list[Any]:
        replies = [cache.get(p) for p in prompts]
        todo = [i for i, reply in enumerate(replies) if reply is None]
        if todo:
            for i, reply in zip(todo, generate([prompts[i] for i in todo])):
                replies[i] = reply
            cache.add([(prompts[i], replies[i]) for i in todo if replies[i] is not None])
        return replies

    return run


def reply_author(recipe: Recipe, tokenizer: Any, model: Any = None) -> tuple[Callable, str, dict]:
    """(generate, where, author): the recipe's reply generator (`data.regenerate_endpoint`, else the
    target's batched loop), where it runs (for the log) and what identifies it (for the cache)."""
    data = recipe.data
    if data.regenerate_endpoint:
        name = endpoint_model(data.regenerate_endpoint, data.regenerate_model)
        generate = endpoint_generator(data.regenerate_endpoint, name, data.regenerate_max_new_tokens,
                                      data.regenerate_temperature, data.regenerate_batch_size)
        return generate, f"{data.regenerate_endpoint} ({name})", {"endpoint": data.regenerate_endpoint, "model": name}
    if model is None:
        model, _ = load_target(recipe.target)
    generate = hf_generator(model, tokenizer, data.regenerate_max_new_tokens, data.regenerate_temperature,
                            recipe.run.seed)
    return generate, "the target (batched KV-cache loop)", target_author(model, tokenizer)


def target_author(model: Any, tokenizer: Any) -> dict:
    """What identifies the target's own loop as a writer, for the reply cache: its weights' identity and dtype."""
    return {"target": target_identity(model.config, tokenizer), "dtype": str(next(model.parameters()).dtype)}


def reply_cache(recipe: Recipe, author: dict) -> ReplyCache:
    """The run's reply cache for replies written by `author` under the recipe's reply settings."""
    data = recipe.data
    return ReplyCache(reply_cache_path(recipe), {**author, "max_new_tokens": data.regenerate_max_new_tokens,
                                                 "temperature": data.regenerate_temperature, "seed": recipe.run.seed})


def regenerate_rows(rows: list[dict], recipe: Recipe, tokenizer: Any, model: Any = None) -> list[dict]:
    """The prepare step: rows with assistant turns rewritten by the target (text rows unchanged)."""
    from tqdm import tqdm

    data = recipe.data
    generate, where, author = reply_author(recipe, tokenizer, model)
    cache = reply_cache(recipe, author)

    def prompt_tokens(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    with tqdm(unit="turn", desc="regenerating", dynamic_ncols=True) as progress:
        new_rows, stats = regenerate_conversations(rows, generate, prompt_tokens, data.max_length,
                                                   data.regenerate_batch_size, progress, cache)
    total = sum(stats.values()) - stats["empty reply"]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(stats.items()) if n)
    reused = f" ({cache.reused} of them from {cache.path})" if cache.reused else ""
    print(f"eyas prepare: regenerated assistant turns with {where}: {summary or 'nothing to do'}{reused}", flush=True)
    if total and stats["kept: endpoint error"] == total:
        raise EyasError(f"every request to data.regenerate_endpoint '{data.regenerate_endpoint}' failed; check the server log")
    return new_rows
