"""Target-written prompts (`data.self_prompts: N`): the target writes the user turns itself.

An instruction-tuned model that is handed its chat template up to an open user turn
("<|im_start|>user\\n") writes the kind of request it was tuned on (the method of Magpie,
Xu et al. 2024). With the replies regenerated as well, these conversations come from the
target's own prompt distribution (questions, writing, code, advice) and need no dataset, so
they widen a chitchat-only training set towards the prompts a deployed draft meets.

Steering (`data.self_prompt_categories`): left alone, a small target writes mostly one kind of
request. With a list of categories, the N prompts are split evenly over them (the first
N mod k categories get one more) and each attempt is steered towards its category by two
things in the text handed to the target: a system prompt saying what kind of user it plays
(only while it writes; the conversation keeps the template's default system prompt), and the
first words of the user turn ("Translate into German:", "Write a Python function that"),
which stay part of the prompt. A category's openers are used in turn. A prompt kept for a
category records it: `category` on the row and in the id (`self-<seed>-<attempt>-<category>`);
prepare counts the mix in `info.json` and its report. `eyas.steering.STEERS` lists the built-in categories;
a recipe can add its own as `{name: "system prompt"}` or `{name: {system: ..., openers: [...]}}`.
Built-in SmolLM2-135M follows the openers far more than the system prompt.

Multi-turn (`data.self_prompt_turns: 2`): after a first user turn is kept, the target answers it
(the regeneration settings), then writes the user's follow-up after its own answer, steered by
the follow-up system prompt and openers ("Can you", "What if"), and answers that too. These
conversations are complete when prepare receives them, so its regeneration pass leaves them as
they are (`replied` on the row). A follow-up that does not end is resampled up to 3 times; a
conversation whose follow-up never ends is kept with one exchange (counted in `info.json`).

Prompts are sampled (temperature and top-p from the recipe), deduplicated — exactly, and as near
duplicates when the Jaccard similarity of their word 3-gram sets with an earlier kept prompt is
`data.self_prompt_dedup` or more (`eyas.ngrams.NearDuplicates`) — and dropped when they are empty
or do not end within `data.regenerate_max_new_tokens`; every drop is counted in `skipped.json`,
with the category in the example. Sampling for a category stops when its share is kept or after
3 attempts per wanted prompt. Every sample, kept or not, goes to the reply cache as its batch ends,
from the target's own loop as from an endpoint (`cached_turn_sampler`), so a killed prepare writes
again only the turns it lacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from eyas.data.regenerate import (
    ReplyCache,
    base_url,
    cached,
    endpoint_model,
    post_choice,
    reply_author,
    reply_cache,
    reply_cache_path,
    target_author,
)
from eyas.decode import SamplingParams, left_padded, plain_decode, seeded_generator, stop_token_ids, token_chooser
from eyas.errors import EyasError
from eyas.ngrams import NearDuplicates
from eyas.recipe_schema import Recipe
from eyas.steering import FOLLOW_UP, Category, Steer, parse_categories

MARK = "\x00EYAS_PROMPT\x00"
ATTEMPTS_PER_PROMPT = 3  # give up after this many samples per wanted prompt (a model that rarely ends its turn)
NOT_ENDED = "self prompt did not end within data.regenerate_max_new_tokens"
EMPTY = "self prompt empty"
DUPLICATE = "self prompt duplicate"
NEAR_DUPLICATE = "self prompt near-duplicate"
FOLLOW_UP_NOT_ENDED = "self prompt follow-up did not end within data.regenerate_max_new_tokens"
FOLLOW_UP_EMPTY = "self prompt follow-up empty"


def quotas(count: int, categories: list[Category]) -> dict[str, int]:
    """`count` prompts split evenly over the categories, the first `count % k` getting one more."""
    k = len(categories)
    return {c.name: count // k + (1 if i < count % k else 0) for i, c in enumerate(categories)}


def user_header(tokenizer: Any, system: str = "", history: list[dict] | None = None) -> str:
    """The chat template's text before a user message's content: the first one (default system prompt
    included), or, after `history`, the next one; with `system` as the system prompt when given."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    try:
        text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": MARK}], tokenize=False)
    except Exception as exc:  # templates raise their own error types
        raise EyasError(f"data.self_prompts: the target's chat template cannot render a user turn ({exc})") from None
    if MARK not in text:
        raise EyasError("data.self_prompts: the target's chat template drops the user message's text; "
                        "set target.chat_template to a template that renders it")
    return text[: text.index(MARK)]


class _Keeper:
    """The keep/drop rules of first user turns, shared by every batch of one prepare."""

    def __init__(self, skips: Any, seed: int, dedup: float):
        self.skips, self.seed = skips, seed
        self.seen: set[str] = set()
        self.near = NearDuplicates(dedup) if dedup < 1.0 else None
        self.kept_texts: list[str] = []

    def keep(self, sampled: str | None, attempt: int, steer: Steer | None) -> dict | None:
        row_id = f"self-{self.seed}-{attempt}" + (f"-{steer.category}" if steer is not None else "")
        where = f"{steer.category}: " if steer is not None else ""
        text = sampled.strip() if sampled is not None else None
        if text is None:
            self.skips.add(NOT_ENDED, row_id, where.rstrip(": "))
            return None
        if not text or (steer is not None and text == steer.opener.strip()):
            self.skips.add(EMPTY, row_id, where.rstrip(": "))
            return None
        if text in self.seen:
            self.skips.add(DUPLICATE, row_id, where + text)
            return None
        if self.near is not None:
            match = self.near.check(text)
            if match is not None:
                self.skips.add(NEAR_DUPLICATE, row_id, f"{where}{text[:90]!r} ~ {self.kept_texts[match][:90]!r}")
                return None
            self.near.add(text)
        self.seen.add(text)
        self.kept_texts.append(text)
        row = {"id": row_id, "messages": [{"role": "user", "content": text}]}
        if steer is not None:
            row["category"] = steer.category
        return row


def write_prompts(sample: Callable[[list[Steer | None]], list[str | None]], count: int, batch_size: int,
                  skips: Any, seed: int, progress: Any = None, categories: list[Category] | None = None,
                  dedup: float = 1.0) -> list[dict]:
    """`count` distinct user turns from `sample(steers) -> one text per steer (None: unfinished)`, in
    batches. Without categories every steer is None; with them each category gets its `quotas` share,
    attempts going round-robin over the categories still short (never more in a batch than a category
    still needs), at most 3 per wanted prompt."""
    keeper = _Keeper(skips, seed, dedup)
    if not categories:
        categories_left = {None: count}
        budget = {None: ATTEMPTS_PER_PROMPT * count}
    else:
        categories_left = dict(quotas(count, categories))
        budget = {name: ATTEMPTS_PER_PROMPT * n for name, n in categories_left.items()}
    by_name = {c.name: c for c in categories or []}
    turns: Counter = Counter()  # attempts per category so far (which opener comes next)
    kept: dict[Any, list[tuple[int, dict]]] = {name: [] for name in categories_left}
    attempt = 0
    cursor = 0
    while True:
        open_names = [n for n in categories_left if len(kept[n]) < categories_left[n] and budget[n] > 0]
        if not open_names:
            break
        steers: list[Steer | None] = []
        names: list[Any] = []
        planned: Counter = Counter()
        while len(steers) < batch_size:
            live = [n for n in open_names  # no more attempts planned than a category still needs
                    if budget[n] - planned[n] > 0 and len(kept[n]) + planned[n] < categories_left[n]]
            if not live:
                break
            name = live[cursor % len(live)]
            cursor += 1
            planned[name] += 1
            steers.append(by_name[name].steer(turns[name]) if name is not None else None)
            turns[name] += 1
            names.append(name)
        samples = sample(steers)
        if len(samples) != len(steers):
            raise ValueError(f"the prompt sampler returned {len(samples)} texts for {len(steers)} steers")
        new = 0
        for name, steer, sampled in zip(names, steers, samples):
            budget[name] -= 1
            if len(kept[name]) >= categories_left[name]:
                attempt += 1
                continue  # the category filled earlier in this batch: not kept, not a drop
            row = keeper.keep(sampled, attempt, steer)
            if row is not None:
                kept[name].append((attempt, row))
                new += 1
            attempt += 1
        if progress is not None:
            progress.update(new)
    return [row for _, row in sorted(pair for name in categories_left for pair in kept[name])]  # attempt order


def _decode_new(tokenizer: Any, new: list[list[int]], stops: set[int]) -> list[str | None]:
    return [tokenizer.decode(seq[:-1], skip_special_tokens=True) if seq and seq[-1] in stops else None for seq in new]


def cached_turn_sampler(ask: Callable[[list[dict]], list[dict]], tokenizer: Any,
                        cache: ReplyCache | None) -> Callable[..., list[str | None]]:
    """`sample(steers, histories=None)` over `ask(keys) -> [{"text", "ended"}]`, a back end continuing each key's
    "prompt" (the template's open user turn, and the steer's opening words).

    Samples, finished or not, are kept in `cache` under (text continued, how many times that text was asked
    before), so a rerun after a kill asks only for the samples it lacks; they are fresh samples, since a
    back end's random stream depends on what it is asked together."""
    ask = cached(ask, cache or ReplyCache(None, {}))
    asked: Counter = Counter()

    def sample(steers: list[Steer | None] | int, histories: list[list[dict]] | None = None) -> list[str | None]:
        if isinstance(steers, int):
            steers = [None] * steers
        if not steers:
            return []
        heads = [user_header(tokenizer, s.system if s else "", histories[i] if histories else None)
                 + (s.opener if s else "") for i, s in enumerate(steers)]
        keys = []
        for head in heads:
            keys.append({"prompt": head, "occurrence": asked[head]})
            asked[head] += 1
        samples = ask(keys)  # unfinished ones are cached too: a rerun needs no target
        return [(s.opener if s else "") + x["text"] if x["ended"] else None for s, x in zip(steers, samples)]

    return sample


def hf_prompt_sampler(model: Any, tokenizer: Any, max_new_tokens: int, temperature: float, top_p: float,
                      seed: int, top_k: int = 0, cache: ReplyCache | None = None) -> Callable[..., list[str | None]]:
    """`sample(steers, histories=None)`: one user turn per steer (None: unsteered; an int n: n unsteered),
    the target writing after its template's user header, opening with the steer's words; after the
    conversation in `histories[i]` when given (a follow-up). None for a turn that did not end.
    Samples are kept in `cache` as `cached_turn_sampler` says."""
    device = next(model.parameters()).device
    stops = set(stop_token_ids(model, tokenizer))  # the end-of-turn token is among them for chat models
    stop_ids = torch.tensor(sorted(stops), device=device)
    choose = token_chooser(SamplingParams(temperature, top_p, top_k), seeded_generator(device, seed))

    def ask_target(keys: list[dict]) -> list[dict]:
        enc = left_padded(tokenizer, [k["prompt"] for k in keys], device)
        texts = _decode_new(tokenizer, plain_decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens,
                                                    stop_ids, choose), stops)
        return [{"text": t or "", "ended": t is not None} for t in texts]

    return cached_turn_sampler(ask_target, tokenizer, cache)


def endpoint_prompt_sampler(endpoint: str, model: str, tokenizer: Any, max_new_tokens: int, temperature: float,
                            top_p: float, workers: int, cache: ReplyCache | None = None, top_k: int = 0
                            ) -> Callable[..., list[str | None]]:
    """`hf_prompt_sampler`'s contract against an OpenAI-compatible server's /v1/completions: the chat
    template is rendered here up to the open user turn and the server continues that raw text (a chat
    endpoint cannot: it always opens an assistant turn), `workers` requests in flight. A turn ends when
    the server stops on the end-of-turn token (`finish_reason: stop`); one cut at `max_new_tokens` is None.

    Samples are kept in `cache` as `cached_turn_sampler` says. The requests carry no seed: vLLM 0.32 on a CPU
    stops its engine on a per-request seed, so sampling follows the server's own `--seed`.
    A request that keeps failing stops prepare with an error; what was sampled is in the cache.
    """
    url = base_url(endpoint) + "/completions"
    # vLLM and SGLang also stop on the EOS tokens of the model's generation config, as the built-in loop does
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def one(prompt: str) -> dict:
        choice = post_choice(url, {"model": model, "prompt": prompt, "max_tokens": max_new_tokens,
                                   "temperature": temperature, "top_p": top_p, "stop_token_ids": stops,
                                   "add_special_tokens": False, "skip_special_tokens": True,
                                   **({"top_k": top_k} if top_k else {})})
        if choice is None or not isinstance(choice.get("text"), str):
            raise EyasError(f"data.self_prompts: a request to {url} failed 3 times; check the server (its log, "
                            "--max-model-len against data.max_length) and run prepare again: the prompts written "
                            "so far are kept in the reply cache")
        return {"text": choice["text"], "ended": choice.get("finish_reason") == "stop"}

    def ask_server(keys: list[dict]) -> list[dict]:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, [k["prompt"] for k in keys]))

    return cached_turn_sampler(ask_server, tokenizer, cache)


def add_follow_ups(rows: list[dict], reply: Callable[[list[list[dict]]], list[str]],
                   sample: Callable[..., list[str | None]], batch_size: int, skips: Any) -> list[dict]:
    """Two-turn conversations: each row's first turn answered (`reply`: prompts -> replies), a follow-up
    user turn written after that answer (`sample(steers, histories)`, up to 3 tries), and answered.
    Rows come back complete (`replied`); one whose follow-up never ended keeps its one exchange."""
    out = [dict(row, messages=[dict(m) for m in row["messages"]]) for row in rows]
    for start in range(0, len(out), batch_size):
        batch = out[start:start + batch_size]
        for row, answer in zip(batch, reply([r["messages"] for r in batch])):
            row["messages"].append({"role": "assistant", "content": answer})
            row["replied"] = True
    pending = [r for r in out if r["messages"][-1]["content"].strip()]  # an empty first answer gets no follow-up
    for tries in range(ATTEMPTS_PER_PROMPT):
        if not pending:
            break
        failed = []
        for start in range(0, len(pending), batch_size):
            batch = pending[start:start + batch_size]
            steers = [FOLLOW_UP.steer(tries + start + i) for i in range(len(batch))]
            for row, steer, text in zip(batch, steers, sample(steers, [r["messages"] for r in batch])):
                text = text.strip() if text is not None else None
                if not text or text == steer.opener.strip():
                    skips.add(FOLLOW_UP_NOT_ENDED if text is None else FOLLOW_UP_EMPTY, row["id"],
                              row.get("category", ""))
                    failed.append(row)
                    continue
                row["messages"].append({"role": "user", "content": text})
        pending = failed
    complete = [r for r in out if r["messages"][-1]["role"] == "user"]
    for start in range(0, len(complete), batch_size):
        batch = complete[start:start + batch_size]
        for row, answer in zip(batch, reply([r["messages"] for r in batch])):
            row["messages"].append({"role": "assistant", "content": answer})
    return out


def category_mix(rows: list[dict]) -> dict[str, int]:
    """Kept target-written conversations per category (empty when unsteered)."""
    return dict(Counter(r["category"] for r in rows if r.get("category")))


def turn_mix(rows: list[dict]) -> dict[str, int]:
    """Target-written conversations by number of user turns ('1', '2')."""
    return {str(k): v for k, v in sorted(Counter(sum(m["role"] == "user" for m in r["messages"])
                                                  for r in rows).items())}


def regenerate_unreplied(rows: list[dict], regenerate: Callable[[list[dict]], list[dict]]) -> list[dict]:
    """`regenerate` applied to the rows not already answered by the target (`replied`), order kept."""
    todo = [i for i, row in enumerate(rows) if not row.get("replied")]
    if len(todo) == len(rows):
        return regenerate(rows)
    out = list(rows)
    for i, row in zip(todo, regenerate([rows[i] for i in todo]) if todo else []):
        out[i] = row
    return out


def self_prompt_rows(recipe: Recipe, model: Any, tokenizer: Any, skips: Any) -> list[dict]:
    """The prepare step: `data.self_prompts` target-written conversations (one or two user turns)."""
    from tqdm import tqdm

    data = recipe.data
    categories = parse_categories(data.self_prompt_categories)
    # what decides a sample besides its prompt and its writer (an endpoint's keys stay as older cache files
    # have them: no seed reaches a server)
    settings = {"user turn": True, "max_new_tokens": data.regenerate_max_new_tokens,
                "temperature": data.self_prompt_temperature, "top_p": data.self_prompt_top_p,
                "top_k": data.self_prompt_top_k}
    if data.regenerate_endpoint:
        name = endpoint_model(data.regenerate_endpoint, data.regenerate_model)
        cache = ReplyCache(reply_cache_path(recipe), {"endpoint": data.regenerate_endpoint, "model": name, **settings})
        sample = endpoint_prompt_sampler(data.regenerate_endpoint, name, tokenizer, data.regenerate_max_new_tokens,
                                         data.self_prompt_temperature, data.self_prompt_top_p,
                                         data.regenerate_batch_size, cache, top_k=data.self_prompt_top_k)
    else:
        cache = ReplyCache(reply_cache_path(recipe), {**target_author(model, tokenizer), **settings,
                                                      "seed": recipe.run.seed})
        sample = hf_prompt_sampler(model, tokenizer, data.regenerate_max_new_tokens, data.self_prompt_temperature,
                                   data.self_prompt_top_p, recipe.run.seed, top_k=data.self_prompt_top_k, cache=cache)
    with tqdm(total=data.self_prompts, unit="prompt", desc="writing prompts", dynamic_ncols=True) as progress:
        rows = write_prompts(sample, data.self_prompts, data.regenerate_batch_size, skips, recipe.run.seed, progress,
                             categories=categories, dedup=data.self_prompt_dedup)
    dropped = sum(n for r, n in skips.counts.items() if r.startswith("self prompt"))
    mix = category_mix(rows)
    listed = f"; categories: {', '.join(f'{k} {v}' for k, v in mix.items())}" if mix else ""
    print(f"eyas prepare: the target wrote {len(rows)} of {data.self_prompts} prompts ({dropped} samples dropped"
          f"{listed})", flush=True)
    if data.self_prompt_turns >= 2 and rows:
        generate, _, author = reply_author(recipe, tokenizer, model)
        rows = add_follow_ups(rows, cached(generate, reply_cache(recipe, author)), sample,
                              data.regenerate_batch_size, skips)
        print(f"eyas prepare: the target wrote follow-up turns: {turn_mix(rows).get('2', 0)} of {len(rows)} "
              "conversations have two user turns", flush=True)
    return rows
