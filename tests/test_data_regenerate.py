"""Regeneration: batched left-padded HF generate equals one-at-a-time greedy; OpenAI endpoint via a fake server."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import JsonHandler, serving

from eyas.config import load_recipe
from eyas.data.prepare import load_prepared, prepare
from eyas.data.regenerate import ReplyCache, endpoint_generator, hf_generator, regenerate_conversations, regenerate_rows

ROWS = [
    {"id": "a", "messages": [{"role": "user", "content": "Hello, how are you doing today?"},
                             {"role": "assistant", "content": "original 1"},
                             {"role": "user", "content": "What is the capital of France?"},
                             {"role": "assistant", "content": "original 2"}]},
    {"id": "b", "messages": [{"role": "user", "content": "Tell me a story about a hawk."},
                             {"role": "assistant", "content": "original 3"}]},
    {"id": "c", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
                             {"role": "assistant", "content": "original 4"}]},
    {"id": "t", "text": "plain text stays"},
]


def test_batched_generate_equals_one_by_one_greedy(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    generate = hf_generator(model, tok, max_new_tokens=10, temperature=0.0, seed=0)

    def prompt_tokens(messages):
        return len(tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"])

    rows, stats = regenerate_conversations(ROWS, generate, prompt_tokens, max_length=512, batch_size=3)
    assert stats["regenerated"] == 4 and rows[3] == ROWS[3]
    for row in rows[:3]:  # replay each conversation alone, turn by turn, unpadded
        so_far = []
        for message in row["messages"]:
            if message["role"] == "assistant":
                assert message["content"] == generate([so_far])[0]
                assert "original" not in message["content"]
            so_far.append(message)
    assert ROWS[0]["messages"][1]["content"] == "original 1"  # the input rows are not modified


def test_finished_rows_leave_the_batch_without_changing_the_others(tiny_llama_dir):
    """Rows that hit EOS early are dropped from the batch and its KV cache; every reply must still
    equal HF `generate` run on that prompt alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = [[{"role": "user", "content": text}] for text in
               ("Hello, how are you doing today?", "hi", "Tell me a story about a hawk, a long one please.", "ok?")]
    singles = [tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
               for p in prompts]
    # make EOS a token the tiny random model does emit, at different steps for different prompts
    free_run = [model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc["input_ids"].shape[1]:] for enc in singles]
    stop = int(free_run[0][3])
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    expected = []
    for enc in singles:
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=[tok.eos_token_id, stop],
                             pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:].tolist()
        expected.append(tok.decode([t for t in out if t not in (stop, tok.eos_token_id)], skip_special_tokens=True).strip())
    lengths = [len(r) for r in expected]
    assert min(lengths) < max(lengths)  # some rows really finish early
    assert hf_generator(model, tok, max_new_tokens=12, temperature=0.0, seed=0)(prompts) == expected


def test_a_tokenizer_without_a_pad_token_generates_the_same_replies(tiny_llama_dir):
    """SmolLM2's tokenizer, loaded plainly, has no pad token: batches pad with EOS under the mask,
    the replies equal those of the same tokenizer with a pad token, and the tokenizer is left as it was."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with_pad, without_pad = AutoTokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    without_pad.pad_token = None
    prompts = [[{"role": "user", "content": text}] for text in ("Hello, how are you doing today?", "hi")]
    expected = hf_generator(model, with_pad, max_new_tokens=8, temperature=0.0, seed=0)(prompts)
    assert hf_generator(model, without_pad, max_new_tokens=8, temperature=0.0, seed=0)(prompts) == expected
    assert without_pad.pad_token is None and without_pad.padding_side == with_pad.padding_side


def test_max_turns_cuts_conversations_and_prompt_only_rows_get_a_reply():
    from eyas.data.sources import first_turns

    seen = []

    def generate(prompts):
        seen.extend(prompts)
        return [f"reply to {p[-1]['content']}" for p in prompts]

    prompt_only = {"id": "p", "messages": [{"role": "user", "content": "only a question"}]}
    cut = first_turns(ROWS + [prompt_only], 1)
    assert len(cut[0]["messages"]) == 2 and cut[3] == ROWS[3] and first_turns(ROWS, 0) is ROWS
    rows, stats = regenerate_conversations(cut, generate, lambda m: 1, max_length=100, batch_size=8)
    assert [m["content"] for m in rows[0]["messages"]] == ["Hello, how are you doing today?",
                                                          "reply to Hello, how are you doing today?"]
    assert rows[4]["messages"][-1] == {"role": "assistant", "content": "reply to only a question"}
    assert stats["regenerated"] == 4 and len(seen) == 4
    assert prompt_only["messages"] == [{"role": "user", "content": "only a question"}]  # input untouched


def test_long_prompts_are_left_alone():
    calls = []

    def generate(prompts):
        calls.extend(prompts)
        return ["new"] * len(prompts)

    rows, stats = regenerate_conversations(ROWS[:1], generate, lambda m: 100 * len(m), max_length=250, batch_size=4)
    assert [m["content"] for m in rows[0]["messages"] if m["role"] == "assistant"] == ["new", "original 2"]
    assert stats["kept: prompt beyond max_length"] == 1 and len(calls) == 1


class FakeServer(JsonHandler):
    requests: list = []
    fail_next = 1  # the first completion request gets a 500: the client must retry

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-target", "object": "model"}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if FakeServer.fail_next:
            FakeServer.fail_next -= 1
            self._send(500, {"error": "busy"})
            return
        FakeServer.requests.append(payload)
        last_user = [m["content"] for m in payload["messages"] if m["role"] == "user"][-1]
        reply = f"echo[{len(payload['messages'])}]: {last_user}"
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})


@pytest.fixture()
def fake_server():
    FakeServer.requests, FakeServer.fail_next = [], 1
    with serving(FakeServer) as url:
        yield url


def test_endpoint_regeneration_through_prepare(tmp_path, tiny_llama_dir, fake_server):
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    recipe = load_recipe(None, [f"target.path={tiny_llama_dir}", f"data.source={source}", f"run.output_dir={tmp_path}",
                                "data.heldout_fraction=0.0", "data.regenerate=true", f"data.regenerate_endpoint={fake_server}",
                                "data.regenerate_max_new_tokens=33", "data.regenerate_batch_size=2"])
    prepare(recipe)
    train = load_prepared(recipe.run_dir, "train")
    by_id = {r["id"]: r["messages"] for r in train}
    assert by_id["a"][1]["content"] == "echo[1]: Hello, how are you doing today?"
    assert by_id["a"][3]["content"] == "echo[3]: What is the capital of France?"
    assert by_id["c"][2]["content"] == "echo[2]: def add(a, b):"
    second_turn = [r for r in FakeServer.requests if len(r["messages"]) == 3 and r["messages"][0]["role"] == "user"][0]
    assert second_turn["messages"][1]["content"] == "echo[1]: Hello, how are you doing today?"  # fed the new reply
    assert {r["model"] for r in FakeServer.requests} == {"fake-target"}
    assert {r["max_tokens"] for r in FakeServer.requests} == {33} and len(FakeServer.requests) == 4
    assert "t" in by_id  # text rows pass through


def test_endpoint_failures_keep_the_original(fake_server):
    FakeServer.fail_next = 10**6
    generate = endpoint_generator(fake_server, "m", 8, 0.0, workers=2, retries=2)
    rows, stats = regenerate_conversations(ROWS[1:2], generate, lambda m: 1, max_length=100, batch_size=2)
    assert rows[0]["messages"][1]["content"] == "original 3" and stats["kept: endpoint error"] == 1
    recipe = load_recipe(None, ["data.regenerate=true", f"data.regenerate_endpoint={fake_server}"])
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="every request"):
        regenerate_rows(ROWS[1:2], recipe, tokenizer=_CountingTokenizer())


class _CountingTokenizer:
    """Just enough tokenizer for prompt lengths."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


class Interrupted(Exception):
    """Stands for a kill in the middle of a regeneration."""


def test_a_killed_regeneration_resumes_from_its_reply_cache(tmp_path):
    """Replies are kept per batch: the rerun asks only for the rest and ends as an uninterrupted run."""
    def reply(p):
        return f"reply {len(p)}: {p[-1]['content']}"

    asked: list = []

    def dies_after_one_batch(prompts):
        if asked:
            raise Interrupted
        asked.extend(prompts)
        return [reply(p) for p in prompts]

    settings = {"target": "t", "max_new_tokens": 8}
    path = tmp_path / "cache.jsonl"
    with pytest.raises(Interrupted):
        regenerate_conversations(ROWS, dies_after_one_batch, lambda m: 1, max_length=100, batch_size=2,
                                 cache=ReplyCache(path, settings))
    assert len(path.read_text().splitlines()) == 2  # the finished batch is on disk
    with open(path, "a") as f:
        f.write('{"key": "torn')  # a kill mid-write leaves a torn line: ignored
    rerun_asked: list = []

    def counting(prompts):
        rerun_asked.extend(prompts)
        return [reply(p) for p in prompts]

    cache = ReplyCache(path, settings)
    resumed, stats = regenerate_conversations(ROWS, counting, lambda m: 1, max_length=100, batch_size=2, cache=cache)
    uninterrupted, _ = regenerate_conversations(ROWS, lambda ps: [reply(p) for p in ps], lambda m: 1, 100, 2)
    assert resumed == uninterrupted
    assert cache.reused == 2 and len(rerun_asked) == 2 and stats["regenerated"] == 4
    assert not {json.dumps(p) for p in rerun_asked} & {json.dumps(p) for p in asked}  # nothing asked twice
    other = ReplyCache(path, {**settings, "max_new_tokens": 16})  # another setting: another key, nothing reused
    regenerate_conversations(ROWS, lambda ps: [reply(p) for p in ps], lambda m: 1, 100, 2, cache=other)
    assert other.reused == 0


def test_prepare_reuses_the_reply_cache_of_an_earlier_run(tmp_path, tiny_llama_dir, fake_server):
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    common = [f"target.path={tiny_llama_dir}", f"data.source={source}", f"run.output_dir={tmp_path}",
              "data.heldout_fraction=0.0", "data.regenerate=true", f"data.regenerate_endpoint={fake_server}",
              "data.regenerate_batch_size=2", f"data.regenerate_cache={tmp_path / 'replies.jsonl'}"]
    prepare(load_recipe(None, common + ["run.name=first"]))
    assert len(FakeServer.requests) == 4
    prepare(load_recipe(None, common + ["run.name=second"]))  # another run with the same cache file
    assert len(FakeServer.requests) == 4  # every reply came from the cache
    first, second = (load_prepared(tmp_path / name, "train") for name in ("first", "second"))
    assert [r["messages"] for r in first] == [r["messages"] for r in second]
    prepare(load_recipe(None, common + ["run.name=third", "data.regenerate_max_new_tokens=20"]))
    assert len(FakeServer.requests) == 8  # another setting asks again
