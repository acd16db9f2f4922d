"""Target-written prompts (data.self_prompts): the template's user header, the keep/drop rules,
seeded sampling on a tiny target, and prepare end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eyas.config import load_recipe
from eyas.data.prepare import load_prepared, prepare
from eyas.data.self_prompts import hf_prompt_sampler, user_header, write_prompts
from eyas.data.sources import Skips
from eyas.errors import EyasError

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
    batches = iter([["What is a hawk?", None, "  ", "What is a hawk?"], ["Write a haiku.", "Sort a list in Python."]])
    skips = Skips()
    rows = write_prompts(lambda n: next(batches)[:n], count=3, batch_size=4, skips=skips, seed=7)
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": t}] for t in
                                              ("What is a hawk?", "Write a haiku.", "Sort a list in Python.")]
    assert [r["id"] for r in rows] == ["self-7-0", "self-7-4", "self-7-5"]  # ids name the attempt: stable per seed
    assert skips.counts == {"self prompt did not end within data.regenerate_max_new_tokens": 1,
                            "self prompt empty": 1, "self prompt duplicate": 1}


def test_write_prompts_gives_up_after_three_attempts_per_prompt():
    asked = []

    def never_ends(n):
        asked.append(n)
        return [None] * n

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
    free_run = model.generate(header.repeat(8, 1), max_new_tokens=6, do_sample=True, pad_token_id=0)[:, header.shape[1]:]
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
                                "data.regenerate=true", "data.regenerate_max_new_tokens=12", "data.heldout_fraction=0.0",
                                "data.regenerate_batch_size=4", f"run.output_dir={tmp_path}"])
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
    (["data.self_prompts=10", "data.regenerate=true", "data.regenerate_endpoint=http://localhost:1"],
     "unset data.regenerate_endpoint"),
    (["data.source=none"], "there is no data"),
    (["data.self_prompts=10", "data.regenerate=true", "data.self_prompt_temperature=0"], "must be > 0"),
])
def test_self_prompt_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(EyasError, match=message):
        load_recipe(None, overrides)
