"""Prepare stage: golden loss masks for published chat templates, skips by reason, max_length policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.config import load_recipe
from eyas.data.prepare import (
    NO_ASSISTANT,
    NOTHING_LEFT,
    TEMPLATE_ERROR,
    TOO_LONG,
    has_generation_markers,
    load_prepared,
    main,
    prepare,
    tokenize_conversation,
)
from eyas.errors import EyasError

TEMPLATES = Path(__file__).parent / "data" / "templates"
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": " Why not.\n"},
]
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="module")
def smol_tokenizer():
    """A byte-level BPE built in code with ChatML's special tokens (as SmolLM2's and Qwen's tokenizers have).

    The golden renders below are the published templates' own text; the loss masks are checked
    against the assistant turns tokenised on their own, so no particular vocabulary is assumed.
    """
    from fixtures import build_tokenizer

    tok = build_tokenizer()
    # Llama-3 header tokens, so the Llama-3.1 template's markers are single special tokens as in Llama-3.
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                         "<|end_header_id|>", "<|eot_id|>"]})
    return tok


def _n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _with_template(tokenizer, name: str):
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def _runs(tokenizer, ids, mask, value=1):
    """Decoded text of each maximal run of tokens whose mask equals `value`."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m == value:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_chatml_smollm2_golden(smol_tokenizer):
    tok = _with_template(smol_tokenizer, "smollm2")
    tok.bos_token = "<|im_start|>"
    ids, mask = tokenize_conversation(tok, CONVERSATION)
    assert tok.decode(ids) == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n Why not.\n<|im_end|>\n"
    )
    assert _runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>", " Why not.\n<|im_end|>"]
    # Every token is the template's text tokenised as a whole; the mask holds each reply and its <|im_end|>.
    assert len(ids) == _n_tokens(tok, tok.decode(ids))
    assert sum(mask) == _n_tokens(tok, "Hello! How can I help?") + _n_tokens(tok, " Why not.\n") + 2
    # The template's own default system prompt is never trained on.
    assert _runs(tok, ids, mask, 0)[0].startswith(f"<|im_start|>system\n{SMOL_SYSTEM}")


def test_chatml_qwen25_default_system_prompt_golden(smol_tokenizer):
    tok = _with_template(smol_tokenizer, "qwen2.5")
    ids, mask = tokenize_conversation(tok, CONVERSATION)
    unmasked = _runs(tok, ids, mask, 0)
    assert unmasked[0] == (f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert _runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>", " Why not.\n<|im_end|>"]
    assert unmasked[-1] == "\n"  # the newline after the last <|im_end|> is template glue, not the assistant's
    # An explicit system prompt replaces the default and stays unmasked.
    ids2, mask2 = tokenize_conversation(tok, [{"role": "system", "content": "Be brief."}] + CONVERSATION)
    assert _runs(tok, ids2, mask2, 0)[0].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert _runs(tok, ids2, mask2) == _runs(tok, ids, mask)


def test_llama31_golden(smol_tokenizer):
    tok = _with_template(smol_tokenizer, "llama3.1")
    tok.bos_token = "<|begin_of_text|>"
    ids, mask = tokenize_conversation(tok, [{"role": "system", "content": "You are terse."}] + CONVERSATION)
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nWhy not.<|eot_id|>"
    )
    # Llama-3.1 trims content; the mask covers the trimmed text and <|eot_id|>, never the headers.
    assert _runs(tok, ids, mask) == ["Hello! How can I help?<|eot_id|>", "Why not.<|eot_id|>"]
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>") and mask[0] == 0


def test_generation_markers_agree_with_prefix_rendering(smol_tokenizer):
    marked = (TEMPLATES / "chatml_generation.jinja").read_text()
    assert has_generation_markers(marked) and not has_generation_markers((TEMPLATES / "smollm2.jinja").read_text())
    tok = _with_template(smol_tokenizer, "smollm2")
    ids_prefix, mask_prefix = tokenize_conversation(tok, CONVERSATION)
    tok.chat_template = marked
    ids_marked, mask_marked = tokenize_conversation(tok, CONVERSATION)
    assert ids_marked == ids_prefix and mask_marked == mask_prefix


def _harmony_tokenizer():
    from fixtures import build_tokenizer

    return build_tokenizer(chat_format="harmony")


def _harmony_library_render(conversation: list[dict], for_completion: bool = False) -> str:
    """gpt-oss's own renderer (openai_harmony, which vLLM installs): the text its training and serving see."""
    import openai_harmony as harmony

    def message(role, content):
        return harmony.Message.from_role_and_content(role, content)

    messages = [message(harmony.Role.SYSTEM, harmony.SystemContent.new())]
    for m in conversation:
        if m["role"] == "system":
            messages.append(message(harmony.Role.DEVELOPER, harmony.DeveloperContent.new().with_instructions(m["content"])))
        elif m["role"] == "user":
            messages.append(message(harmony.Role.USER, m["content"]))
        else:
            messages.append(message(harmony.Role.ASSISTANT, m["content"]).with_channel("final"))
    encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    rendered = harmony.Conversation.from_messages(messages)
    tokens = (encoding.render_conversation_for_completion(rendered, harmony.Role.ASSISTANT) if for_completion
              else encoding.render_conversation_for_training(rendered))
    return encoding.decode(tokens)


@pytest.mark.parametrize("system", [[], [{"role": "system", "content": "You are terse."}]], ids=["default", "developer"])
def test_gpt_oss_harmony_golden(system):
    tok = _harmony_tokenizer()
    conversation = system + CONVERSATION
    ids, mask = tokenize_conversation(tok, conversation)
    assert tok.decode(ids) == _harmony_library_render(conversation)
    assert tok.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True) == \
        _harmony_library_render(conversation[:-1], for_completion=True)
    # After the generation prompt `<|start|>assistant` the model writes the channel header, its reply and the
    # turn's end: all trained. The last turn ends <|return|> (the token that stops generation), earlier ones
    # <|end|> (what the template writes once another turn follows), each taken from the full render.
    assert _runs(tok, ids, mask) == ["<|channel|>final<|message|>Hello! How can I help?<|end|>",
                                     "<|channel|>final<|message|> Why not.\n<|return|>"]
    assert _runs(tok, ids, mask, 0)[-1] == "<|start|>user<|message|>Tell me a joke.<|end|><|start|>assistant"


def test_prepare_on_a_gpt_oss_target_trains_each_reply_in_its_harmony_frame(tmp_path):
    """The stage on a tiny gpt-oss target whose folder carries the harmony template: every prepared row is the
    library's own render of its conversation, and exactly the replies in their frames are trained."""
    from fixtures import build_tiny_target

    from eyas.data.sources import chitchat_rows

    target = build_tiny_target(tmp_path / "gpt_oss", "gpt_oss", chat_format="harmony")
    rows = [r for r in chitchat_rows() if any(m["role"] == "assistant" for m in r["messages"])][:12]
    source = _write_jsonl(tmp_path / "rows.jsonl", rows)
    prepare(_recipe(tmp_path, target, source, "data.max_length=16384", "data.overflow=drop"))
    tok = _harmony_tokenizer()
    prepared = load_prepared(tmp_path / "runs/default", "train")
    assert len(prepared) == 12, (tmp_path / "runs/default/prepared/skipped.json").read_text()
    for row in prepared:
        assert tok.decode(row["input_ids"]) == _harmony_library_render(row["messages"])
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        ends = ["<|end|>"] * (len(replies) - 1) + ["<|return|>"]
        assert _runs(tok, row["input_ids"], row["loss_mask"]) == [
            f"<|channel|>final<|message|>{reply}{end}" for reply, end in zip(replies, ends)]


@pytest.mark.parametrize("family", ["chatml", "harmony"])
def test_non_prefix_template_falls_back_to_content_search(smol_tokenizer, family):
    # A template that rewrites earlier assistant turns (like "thinking" templates dropping thoughts):
    # only the last assistant turn keeps its <think> block, so prefix renders are not prefixes.
    # In harmony's form the last turn's end (<|return|>) differs from an earlier one's (<|end|>): each is found.
    start, end_last, end_history = (("<|im_start|>{{ m.role }}\n", "<|im_end|>\n", "<|im_end|>\n")
                                    if family == "chatml" else ("<|start|>{{ m.role }}<|message|>", "<|return|>", "<|end|>"))
    tok = smol_tokenizer if family == "chatml" else _harmony_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}" + start +
        "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
        "{% else %}{{ m.content }}{% endif %}"
        f"{{% if m.role == 'assistant' and loop.last %}}{end_last}{{% else %}}{end_history}{{% endif %}}{{% endfor %}}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>one"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"}]
    ids, mask = tokenize_conversation(tok, msgs)
    assert _runs(tok, ids, mask) == [f"one{end_history.strip()}", f"two{end_last.strip()}"]


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _recipe(tmp_path, target_dir, source, *extra):
    return load_recipe(None, [f"target.path={target_dir}", f"data.source={source}", f"run.output_dir={tmp_path}/runs",
                              "data.heldout_fraction=0.0", *extra])


def test_skips_counted_by_reason_and_listed(tmp_path, tiny_llama_dir, capsys):
    long_answer = "word " * 400
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]},
        "{not json",
        {"id": "no-assistant", "messages": [{"role": "user", "content": "anyone?"}]},
        {"id": "empty", "messages": []},
        {"id": "blank", "messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": ""}]},
        {"id": "too-long", "messages": [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": long_answer}]},
        {"id": "bad-role", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "twice", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                     {"role": "assistant", "content": "c"}]},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "Hey"}, {"from": "gpt", "value": "Yo"}]},
        {"id": "plain", "text": "The quick brown fox jumps over the lazy dog."},
    ]
    source = _write_jsonl(tmp_path / "rows.jsonl", rows)
    strict = tmp_path / "strict.jinja"  # a template that rejects non-alternating roles, like Llama-2/Mistral
    strict.write_text(
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"target:\n  path: {tiny_llama_dir}\n  chat_template: {strict}\n"
                           f"data:\n  source: {source}\n  heldout_fraction: 0.0\n  max_length: 64\n  overflow: drop\n"
                           f"run:\n  output_dir: {tmp_path}/runs\n")
    assert main([str(recipe_path)]) == 0
    printed = capsys.readouterr().out
    skipped = json.loads((tmp_path / "runs/default/prepared/skipped.json").read_text())
    assert skipped["counts"] == {"malformed JSON line": 1, "malformed row": 1, NO_ASSISTANT: 1, "empty conversation": 2,
                                 TOO_LONG: 1, TEMPLATE_ERROR: 1}
    assert skipped["total"] == 7
    assert "raise_exception" not in json.dumps(skipped)
    assert "alternate" in json.dumps(skipped["examples"][TEMPLATE_ERROR])
    assert "skipped 7 rows" in printed and "1 longer than max_length" in printed
    train = load_prepared(tmp_path / "runs/default", "train")
    assert sorted(train["id"]) == ["ok", "plain", "sharegpt"]
    plain = train[train["id"].index("plain")]
    assert all(plain["loss_mask"]) and len(plain["messages"]) == 0
    ok = train[train["id"].index("ok")]
    assert ok["messages"] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    assert sum(ok["loss_mask"]) > 0 and len(ok["input_ids"]) == len(ok["loss_mask"])


def test_truncate_keeps_prefix_and_counts_empty_results(tmp_path, tiny_llama_dir):
    rows = [
        {"id": "long", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 200}]},
        {"id": "late", "messages": [{"role": "user", "content": "question " * 200},
                                    {"role": "assistant", "content": "a"}]},
    ]
    source = _write_jsonl(tmp_path / "rows.jsonl", rows)
    recipe = _recipe(tmp_path, tiny_llama_dir, source, "data.max_length=48", "data.overflow=truncate")
    info = prepare(recipe)
    assert info["skipped"] == {NOTHING_LEFT: 1}
    train = load_prepared(recipe.run_dir, "train")
    assert train["id"] == ["long"] and len(train[0]["input_ids"]) == 48 and train[0]["loss_mask"][-1] == 1
    assert len(load_prepared(recipe.run_dir, "heldout")) == 0  # an empty split is still a dataset
    from eyas.data.dump import dump

    manifest = dump(recipe)
    assert manifest["num_samples"] == 1
    assert json.loads((recipe.run_dir / "shards" / "heldout" / "manifest.json").read_text())["num_samples"] == 0


def test_system_prompt_added_and_heldout_split(tmp_path, tiny_llama_dir):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"hello {i}"},
                                         {"role": "assistant", "content": f"hi {i}"}]} for i in range(40)]
    source = _write_jsonl(tmp_path / "rows.jsonl", rows)
    recipe = _recipe(tmp_path, tiny_llama_dir, source, "data.system_prompt=Be kind.", "data.heldout_fraction=0.25")
    prepare(recipe)
    train, heldout = load_prepared(recipe.run_dir, "train"), load_prepared(recipe.run_dir, "heldout")
    assert len(train) + len(heldout) == 40 and 0 < len(heldout) < 20
    assert not set(train["id"]) & set(heldout["id"])
    assert train[0]["messages"][0] == {"role": "system", "content": "Be kind."}
    assert (recipe.run_dir / "prepared" / "recipe.yaml").is_file()


def test_load_prepared_missing_says_what_to_run(tmp_path):
    with pytest.raises(EyasError, match="eyas prepare"):
        load_prepared(tmp_path, "train")
