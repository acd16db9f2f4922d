"""Target-written prompts (data.self_prompts): the template's user header, the keep/drop rules,
seeded sampling on a tiny target, and prepare end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures import JsonHandler, serving

from eyas.config import load_recipe
from eyas.data import regenerate, self_prompts
from eyas.data.prepare import load_prepared, prepare
from eyas.data.regenerate import ReplyCache
from eyas.data.self_prompts import (
    DUPLICATE,
    NEAR_DUPLICATE,
    add_follow_ups,
    category_mix,
    endpoint_prompt_sampler,
    hf_prompt_sampler,
    quotas,
    regenerate_unreplied,
    turn_mix,
    user_header,
    write_prompts,
)
from eyas.data.sources import Skips
from eyas.errors import EyasError
from eyas.steering import FOLLOW_UP, STEERS, Category, parse_categories

TEMPLATES = Path(__file__).parent / "data" / "templates"


@pytest.mark.parametrize("template, header_end", [
    ("smollm2.jinja", "<|im_start|>user\n"),
    ("qwen2.5.jinja", "<|im_start|>user\n"),
    ("llama3.1.jinja", "<|start_header_id|>user<|end_header_id|>\n\n"),
])
def test_user_header_is_what_the_template_puts_before_a_user_message(tiny_llama_dir, template, header_end):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = (TEMPLATES / template).read_text()
    header = user_header(tok)
    assert header.endswith(header_end)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Name three birds."}], tokenize=False)
    assert rendered.startswith(header + "Name three birds.")


def test_write_prompts_keeps_distinct_finished_prompts_and_counts_the_rest():
    batches = iter([["What is a hawk?", None, "  "], ["What is a hawk?", "Write a haiku."], ["Sort a list in Python."]])
    # no more attempts per batch than prompts still wanted: 3, then 2, then 1
    skips = Skips()
    rows = write_prompts(lambda steers: next(batches)[:len(steers)], count=3, batch_size=4, skips=skips, seed=7)
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": t}] for t in
                                              ("What is a hawk?", "Write a haiku.", "Sort a list in Python.")]
    assert [r["id"] for r in rows] == ["self-7-0", "self-7-4", "self-7-5"]
    assert next(batches, "used up") == "used up"  # ids name the attempt: stable per seed
    assert skips.counts == {"self prompt did not end within data.regenerate_max_new_tokens": 1,
                            "self prompt empty": 1, "self prompt duplicate": 1}


def test_write_prompts_gives_up_after_three_attempts_per_prompt():
    asked = []

    def never_ends(steers):
        assert all(s is None for s in steers)  # no categories: unsteered
        asked.append(len(steers))
        return [None] * len(steers)

    skips = Skips()
    assert write_prompts(never_ends, count=4, batch_size=5, skips=skips, seed=0) == []
    assert sum(asked) == 12 and skips.total == 12


def _tiny_that_ends_turns(tiny_llama_dir):
    """The tiny random target, with a token it really emits after the user header made a stop token,
    so its prompts end (a random model would otherwise run to the limit)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    header = tok(user_header(tok), add_special_tokens=False, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    free_run = model.generate(header.repeat(8, 1), max_new_tokens=6, do_sample=True, pad_token_id=0)
    free_run = free_run[:, header.shape[1]:]
    common = torch.bincount(free_run.flatten()).argmax()
    model.generation_config.eos_token_id = [tok.eos_token_id, int(common)]
    return model, tok


def test_sampler_is_seeded_and_continues_the_user_header(tiny_llama_dir):
    model, tok = _tiny_that_ends_turns(tiny_llama_dir)
    first = hf_prompt_sampler(model, tok, 12, 1.0, 0.95, seed=3)(6)
    again = hf_prompt_sampler(model, tok, 12, 1.0, 0.95, seed=3)(6)
    other = hf_prompt_sampler(model, tok, 12, 1.0, 0.95, seed=4)(6)
    assert first == again and first != other
    assert any(t is not None for t in first) and all(t is None or isinstance(t, str) for t in first)


def test_prepare_with_only_self_prompts(tmp_path, tiny_llama_dir):
    model, tok = _tiny_that_ends_turns(tiny_llama_dir)
    recipe = load_recipe(None, [f"target.path={tiny_llama_dir}", "data.source=none", "data.self_prompts=5",
                                "data.regenerate=true", "data.regenerate_max_new_tokens=12",
                                "data.heldout_fraction=0.0", "data.regenerate_batch_size=4",
                                f"run.output_dir={tmp_path}"])
    info = prepare(recipe, tokenizer=tok, model=model)
    rows = list(load_prepared(recipe.run_dir, "train"))
    written = info["self_prompts"]
    assert 0 < written <= 5 and len(rows) == written == info["splits"]["train"]["samples"]
    for row in rows:
        assert row["id"].startswith("self-0-")
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]  # the target's reply was added
        assert sum(row["loss_mask"]) > 0
    assert len({r["messages"][0]["content"] for r in rows}) == written
    dropped = sum(n for reason, n in info["skipped"].items() if reason.startswith("self prompt"))
    assert written == 5 or dropped >= 1  # any shortfall is counted


@pytest.mark.parametrize("overrides, message", [
    (["data.self_prompts=10"], "needs data.regenerate: true"),
    (["data.source=none"], "there is no data"),
    (["data.self_prompts=10", "data.regenerate=true", "data.self_prompt_temperature=0"], "must be > 0"),
])
def test_self_prompt_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(EyasError, match=message):
        load_recipe(None, overrides)


# ----------------------------------------------------------------------------- steering, dedup, two turns


def _scripted(fail_every: dict[str, int] | None = None):
    """A fake sampler: a distinct prompt per steer, opening with its opener; `fail_every[c] = k`: every
    k-th attempt of category c does not end. Records the steers it was asked for."""
    asked, seen = [], {}

    def sample(steers):
        out = []
        for steer in steers:
            asked.append(steer)
            n = seen[steer.category] = seen.get(steer.category, 0) + 1
            k = (fail_every or {}).get(steer.category)
            out.append(None if k and n % k == 0 else f"{steer.opener} {steer.category} request number {n} " * 2)
        return out

    return sample, asked


def test_steered_prompts_follow_the_requested_mix_and_record_their_category():
    categories = parse_categories(["coding", "translation", "maths", {"gardening": "You ask about your garden."}])
    sample, asked = _scripted(fail_every={"translation": 2})  # half of translation's attempts do not end
    skips = Skips()
    rows = write_prompts(sample, count=10, batch_size=4, skips=skips, seed=5, categories=categories, dedup=0.7)
    assert quotas(10, categories) == {"coding": 3, "translation": 3, "maths": 2, "gardening": 2}
    assert category_mix(rows) == quotas(10, categories)  # the misses were made up by more attempts
    assert skips.counts == {"self prompt did not end within data.regenerate_max_new_tokens": 2}
    for row in rows:
        assert row["id"].endswith("-" + row["category"]) and row["id"].startswith("self-5-")
        assert row["category"] in row["messages"][0]["content"]  # the prompt written under that category's steer
    assert [int(r["id"].split("-")[2]) for r in rows] == sorted(int(r["id"].split("-")[2]) for r in rows)
    # round-robin: the first attempts cycle over the categories, each with its system prompt and openers in turn
    assert [s.category for s in asked[:4]] == ["coding", "translation", "maths", "gardening"]
    coding = [s for s in asked if s.category == "coding"]
    assert [s.opener for s in coding] == list(STEERS["coding"].openers[:3])
    assert all(s.system == STEERS["coding"].system for s in coding)
    assert rows[0]["messages"][0]["content"].startswith("Write a Python function that")


def test_a_category_that_never_ends_gives_up_and_the_others_are_unaffected():
    categories = parse_categories(["qa", "chat"])
    sample, asked = _scripted(fail_every={"chat": 1})
    skips = Skips()
    rows = write_prompts(sample, count=6, batch_size=5, skips=skips, seed=0, categories=categories)
    assert category_mix(rows) == {"qa": 3}
    assert sum(s.category == "chat" for s in asked) == 9 and skips.total == 9


def test_near_duplicates_are_dropped_and_counted():
    texts = iter(["What is the capital of France?", "what is the capital of France ??",
                  "What is the capital of France?",
                  "Write a short poem about the sea at night.", "Write a short poem about the sea at night, please!",
                  "Write a short poem about a forest in the morning.", "Sort a list of numbers in Python."])
    skips = Skips()
    rows = write_prompts(lambda steers: [next(texts) for _ in steers], count=4, batch_size=7, skips=skips, seed=1,
                         dedup=0.7)
    assert [r["messages"][0]["content"] for r in rows] == [
        "What is the capital of France?", "Write a short poem about the sea at night.",
        "Write a short poem about a forest in the morning.", "Sort a list of numbers in Python."]
    assert skips.counts == {NEAR_DUPLICATE: 2, DUPLICATE: 1}
    assert "~ 'Write a short poem about the sea at night.'" in skips.examples[NEAR_DUPLICATE][1]["detail"]

    exact_only = Skips()
    texts = iter(["What is the capital of France?", "what is the capital of France ??"])
    rows = write_prompts(lambda steers: [next(texts) for _ in steers], count=2, batch_size=2, skips=exact_only,
                         seed=1, dedup=1.0)
    assert len(rows) == 2 and exact_only.total == 0  # dedup 1.0: only exact repeats are dropped


def test_near_duplicate_index_scores_jaccard_of_word_shingles():
    from eyas.ngrams import NearDuplicates, jaccard, shingles

    index = NearDuplicates(threshold=0.5, n=3)
    index.add("the quick brown fox jumps")
    index.add("a completely different sentence here")
    assert index.check("The quick brown fox jumps high") == 0  # 3 of 4 shingles shared
    assert index.check("a quick brown dog sleeps") is None
    assert jaccard(shingles("one two"), shingles("One, two!")) == 1.0  # shorter than n: one shingle
    with pytest.raises(ValueError):
        NearDuplicates(threshold=0.0)


def test_two_turn_conversations_alternate_and_are_not_regenerated_again():
    rows = [{"id": "self-0-0-qa", "category": "qa", "messages": [{"role": "user", "content": "Name a bird."}]},
            {"id": "self-0-1-chat", "category": "chat", "messages": [{"role": "user", "content": "Any tips?"}]}]
    replies = iter(["A hawk.", "Sleep well.", "Falcons fly fast.", "Walk daily."])
    follow = iter([[None, "Can you say more?"], ["Why is that?"]])  # row 0's first follow-up did not end
    histories = []

    def sample(steers, history):
        histories.append([m["content"] for m in history[0]])
        assert all(s.category == FOLLOW_UP.name and s.opener in FOLLOW_UP.openers for s in steers)
        return next(follow)

    skips = Skips()
    out = add_follow_ups(rows, lambda prompts: [next(replies) for _ in prompts], sample, batch_size=4, skips=skips)
    assert [[m["role"] for m in r["messages"]] for r in out] == [["user", "assistant", "user", "assistant"]] * 2
    assert [m["content"] for m in out[0]["messages"]] == ["Name a bird.", "A hawk.", "Why is that?",
                                                          "Falcons fly fast."]
    assert out[1]["messages"][2]["content"] == "Can you say more?"
    assert histories[0] == ["Name a bird.", "A hawk."]  # the follow-up is written after the target's own answer
    assert skips.counts == {"self prompt follow-up did not end within data.regenerate_max_new_tokens": 1}
    assert turn_mix(out) == {"2": 2} and all(r["replied"] for r in out)
    assert rows[0]["messages"] == [{"role": "user", "content": "Name a bird."}]  # the input is not changed

    regenerated = []
    mixed = out + [{"id": "chitchat-1", "messages": [{"role": "user", "content": "hi"}]}]
    result = regenerate_unreplied(mixed, lambda todo: regenerated.extend(todo) or [dict(r, done=True) for r in todo])
    assert [r["id"] for r in regenerated] == ["chitchat-1"] and result[:2] == out and result[2]["done"]


def test_user_header_after_a_conversation_and_under_a_steering_system_prompt(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = (TEMPLATES / "smollm2.jinja").read_text()
    history = [{"role": "user", "content": "Name a bird."}, {"role": "assistant", "content": "A hawk."}]
    after = user_header(tok, history=history)
    assert tok.apply_chat_template(history + [{"role": "user", "content": "Why?"}], tokenize=False) == after + \
        "Why?<|im_end|>\n"
    steered = user_header(tok, system="You are a user who asks about maths.")
    assert steered.startswith("<|im_start|>system\nYou are a user who asks about maths.<|im_end|>")
    assert "SmolLM" in user_header(tok) and "SmolLM" not in steered  # the default system prompt, only unsteered


def test_steered_sampler_on_a_tiny_target_is_seeded_and_opens_with_the_steer(tiny_llama_dir):
    model, tok = _tiny_that_ends_turns(tiny_llama_dir)
    steers = [c.steer(i) for i, c in enumerate(parse_categories(["coding", "translation", "maths"]))]
    first = hf_prompt_sampler(model, tok, 12, 1.0, 0.95, seed=3)(steers)
    again = hf_prompt_sampler(model, tok, 12, 1.0, 0.95, seed=3)(steers)
    assert first == again and len(first) == 3
    assert any(t is not None for t in first)
    for steer, text in zip(steers, first):
        assert text is None or text.startswith(steer.opener)


def test_prepare_with_steered_two_turn_self_conversations_and_again_from_the_reply_cache(tmp_path, tiny_llama_dir,
                                                                                          monkeypatch):
    model, tok = _tiny_that_ends_turns(tiny_llama_dir)
    recipe = load_recipe(None, [f"target.path={tiny_llama_dir}", "data.source=none", "data.self_prompts=6",
                                "data.self_prompt_categories=[coding, qa, translation]", "data.self_prompt_turns=2",
                                "data.regenerate=true", "data.regenerate_max_new_tokens=24",
                                "data.heldout_fraction=0.0", "data.regenerate_batch_size=4", "run.seed=3",
                                f"run.output_dir={tmp_path}"])
    info = prepare(recipe, tokenizer=tok, model=model)
    rows = list(load_prepared(recipe.run_dir, "train"))
    assert len(rows) == info["self_prompts"] > 0
    mix = info["self_prompt_categories"]
    assert mix == {"coding": 2, "qa": 2, "translation": 2}  # as requested (seeded), though samples were dropped:
    assert info["skipped"]["self prompt did not end within data.regenerate_max_new_tokens"] > 0
    openers = {name: STEERS[name].openers for name in mix}
    for row in rows:
        category = row["id"].rsplit("-", 1)[1]
        assert row["messages"][0]["content"].startswith(openers[category])  # written under its category's steer
        roles = [m["role"] for m in row["messages"]]
        assert roles in (["user", "assistant"], ["user", "assistant", "user", "assistant"])
        assert sum(row["loss_mask"]) > 0
    assert info["self_prompt_turns"] == {str(k): sum(len(r["messages"]) == 2 * k for r in rows) for k in (1, 2)
                                         if any(len(r["messages"]) == 2 * k for r in rows)}
    assert info["self_prompt_turns"] == {"1": 2, "2": 4}  # two follow-ups never ended within 3 tries: one exchange
    assert info["skipped"]["self prompt follow-up did not end within data.regenerate_max_new_tokens"] > 0

    # the same prepare again (as after a kill): every user turn, dropped samples too, and every reply comes from
    # the reply cache; the target is never run
    def target_run(*args, **kwargs):
        raise AssertionError("the target wrote a turn the reply cache holds")

    monkeypatch.setattr(self_prompts, "plain_decode", target_run)
    monkeypatch.setattr(regenerate, "plain_decode", target_run)
    again = prepare(recipe, tokenizer=tok, model=model)
    assert [r["messages"] for r in load_prepared(recipe.run_dir, "train")] == [r["messages"] for r in rows]
    assert again["skipped"] == info["skipped"]


@pytest.mark.parametrize("overrides, message", [
    (["data.self_prompt_categories=[coding, cooking]"], "unknown category 'cooking'"),
    (["data.self_prompt_categories=[coding, coding]"], "listed twice"),
    (["data.self_prompt_categories=[{Bad Name: ask things}]"], "must be lower-case"),
    (["data.self_prompt_categories=[{mine: {system: s, colour: red}}]"], "takes 'system'"),
    (["data.self_prompt_categories=[[coding]]"], "must be a category name or a one-key mapping"),
    (["data.self_prompt_turns=3"], "choose 1"),
    (["data.self_prompt_dedup=0"], "must be in \\(0.0, 1.0\\]"),
])
def test_steering_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(EyasError, match=message):
        load_recipe(None, ["data.self_prompts=10", "data.regenerate=true", *overrides])


def test_steering_without_self_prompts_is_refused():
    with pytest.raises(EyasError, match="data.self_prompts is 0"):
        load_recipe(None, ["data.self_prompt_categories=[coding]"])


def test_custom_categories_take_a_system_prompt_and_openers():
    mine, plain = parse_categories([{"cooking": {"system": "You ask about recipes.", "openers": ["How do I cook"]}},
                                    {"gardening": "You ask about your garden."}])
    assert mine == Category("cooking", "You ask about recipes.", ("How do I cook",))
    assert mine.steer(5).opener == "How do I cook" and plain.steer(0).opener == "" and plain.system


# ----------------------------------------------------------------------------- through an endpoint


class CompletionServer(JsonHandler):
    """An OpenAI-style server whose answer is a function of the request alone: /v1/completions
    continues a prompt with text fixed by the prompt, cut at max_tokens when the prompt asks
    for "never"; /v1/chat/completions echoes the last user turn."""
    requests: list = []

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "fake-target", "object": "model"}]})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        CompletionServer.requests.append((self.path, payload))
        if self.path == "/v1/completions":
            cut = "never" in payload["prompt"].lower()
            text = f" sample {payload.get('seed', 0)} of {len(payload['prompt'])}"
            self._send(200, {"choices": [{"index": 0, "text": text, "finish_reason": "length" if cut else "stop"}]})
        else:
            last_user = [m["content"] for m in payload["messages"] if m["role"] == "user"][-1]
            self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"re: {last_user}"}}]})


@pytest.fixture()
def completion_server():
    CompletionServer.requests = []
    with serving(CompletionServer) as url:
        yield url


def test_endpoint_sampler_continues_the_open_user_turn_and_resumes_from_its_cache(tmp_path, tiny_llama_dir,
                                                                                  completion_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    coding = parse_categories(["coding"])[0]
    never = Category("never", "Never stop.", ("Never",))
    steers = [coding.steer(0), coding.steer(0), None, never.steer(0)]
    cache_file = tmp_path / "cache.jsonl"

    def sampler(workers: int):
        return endpoint_prompt_sampler(completion_server, "fake-target", tok, 16, 1.0, 0.9, workers=workers,
                                       cache=ReplyCache(cache_file, {"user turn": True}))

    first = sampler(workers=4)(steers)
    asked = [p for _, p in CompletionServer.requests]
    assert len(asked) == 4 and first[3] is None  # cut at max_tokens: not a prompt
    head = user_header(tok, coding.system) + coding.openers[0]  # the open user turn, continued
    assert sum(p["prompt"] == head for p in asked) == 2
    assert first[0] == first[1] == head.removeprefix(user_header(tok, coding.system)) + f" sample 0 of {len(head)}"
    assert first[2] == f" sample 0 of {len(user_header(tok))}"
    assert {(p["max_tokens"], p["temperature"], p["top_p"], p["add_special_tokens"]) for p in asked} == {(16, 1.0, 0.9, False)}
    assert all(tok.eos_token_id in p["stop_token_ids"] and "seed" not in p for p in asked)

    CompletionServer.requests.clear()  # a rerun (another process, one worker): the cache answers all, unfinished too
    again = sampler(workers=1)(steers)
    assert again == first and CompletionServer.requests == []
    CompletionServer.requests.clear()  # the same text asked a third time is a new sample, not the cached one
    assert sampler(workers=1)([coding.steer(0)] * 3)[2] is not None
    assert [p["prompt"] for _, p in CompletionServer.requests] == [head]
    CompletionServer.requests.clear()  # data.self_prompt_top_k reaches the server; off, it is not sent
    endpoint_prompt_sampler(completion_server, "fake-target", tok, 16, 1.0, 0.9, workers=1, top_k=50)(1)
    assert CompletionServer.requests[0][1]["top_k"] == 50


def test_endpoint_sampler_stops_with_a_clear_error_when_the_server_is_gone(tiny_llama_dir):
    from transformers import AutoTokenizer

    from eyas.eval.engine_vllm import free_port

    sample = endpoint_prompt_sampler(f"http://127.0.0.1:{free_port()}", "m", AutoTokenizer.from_pretrained(tiny_llama_dir),
                                     8, 1.0, 0.9, workers=2)
    with pytest.raises(EyasError, match="failed 3 times; check the server"):
        sample(2)


def test_prepare_writes_two_turn_conversations_through_an_endpoint_and_resumes(tmp_path, tiny_llama_dir,
                                                                               completion_server):
    overrides = [f"target.path={tiny_llama_dir}", "data.source=none", "data.self_prompts=4",
                 "data.self_prompt_categories=[coding, translation]", "data.self_prompt_turns=2",
                 "data.regenerate=true", f"data.regenerate_endpoint={completion_server}", "data.regenerate_batch_size=3",
                 "data.heldout_fraction=0.0", "data.self_prompt_dedup=1.0", f"run.output_dir={tmp_path}"]
    recipe = load_recipe(None, overrides)
    info = prepare(recipe)
    rows = list(load_prepared(recipe.run_dir, "train"))
    assert info["self_prompt_categories"] == {"coding": 2, "translation": 2}
    assert info["self_prompt_turns"] == {"2": 4}
    for row in rows:
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert replies == [f"re: {u}" for u in users]  # each turn answered by the endpoint, in order
    paths = {path for path, _ in CompletionServer.requests}
    assert paths == {"/v1/completions", "/v1/chat/completions"}

    CompletionServer.requests.clear()  # the same prepare again: every sample and reply from the cache
    prepare(load_recipe(None, overrides))
    assert CompletionServer.requests == []
    assert [r["messages"] for r in load_prepared(recipe.run_dir, "train")] == [r["messages"] for r in rows]
