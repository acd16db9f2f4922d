"""The broad evaluation set (benchmarks/prompts/broad.jsonl): it loads through eyas's own prompt
loader, is as broad as documented, has no near-duplicates, and shares no word 8-gram with the chat
training data the recipes use (chitchat) or with the repo's other prompt files."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from eyas.eval.prompts import load_prompts
from eyas.ngrams import ngram_overlap, shared_ngram_pairs

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "prompts"
BROAD = PROMPTS / "broad.jsonl"
N = 8  # word n-gram length of the overlap checks


def _rows() -> list[dict]:
    return [json.loads(line) for line in BROAD.read_text().splitlines() if line.strip()]


def _turn_texts(rows: list[dict]) -> list[str]:
    return [turn for row in rows for turn in row["turns"]]


def _strings_of(row) -> list[str]:
    """Every user-visible text of a prompt row in any accepted form (turns, messages, prompt)."""
    if not isinstance(row, dict):
        return []
    out = [t for t in row.get("turns") or [] if isinstance(t, str)]
    out += [m["content"] for m in row.get("messages") or []
            if isinstance(m, dict) and isinstance(m.get("content"), str)]
    if isinstance(row.get("prompt"), str):
        out.append(row["prompt"])
    return out


@pytest.fixture(scope="module")
def chitchat_texts() -> list[str]:
    from eyas.data.sources import chitchat_rows

    return [m["content"] for row in chitchat_rows() for m in row["messages"]]


def test_the_set_loads_through_the_eval_loader_with_nothing_skipped():
    prompts, skipped = load_prompts(str(BROAD))
    rows = _rows()
    assert skipped == {} and len(prompts) == len(rows) >= 150
    assert len({p.id for p in prompts}) == len(prompts)  # ids are unique
    for prompt, row in zip(prompts, rows):
        assert prompt.id == row["question_id"] and prompt.category == row["category"]
        assert prompt.messages == [{"role": "user", "content": row["turns"][0]}]


def test_the_set_is_broad_and_a_third_of_it_is_two_turn():
    rows = _rows()
    counts = Counter(row["category"] for row in rows)
    assert len(counts) >= 12 and min(counts.values()) >= 8, counts
    assert all(isinstance(t, str) and t.strip() for row in rows for t in row["turns"])
    lengths = Counter(len(row["turns"]) for row in rows)
    assert set(lengths) <= {1, 2}
    assert 3 * lengths[2] >= len(rows), lengths
    two_turn_categories = {row["category"] for row in rows if len(row["turns"]) == 2}
    assert len(two_turn_categories) >= 12  # follow-ups are spread over the categories, not one corner


def test_the_readme_counts_are_the_files():
    table = dict(re.findall(r"^\| `([a-z_]+)` \| (\d+) \|", (PROMPTS / "README.md").read_text(), re.M))
    counts = Counter(row["category"] for row in _rows())
    assert {k: int(v) for k, v in table.items()} == dict(counts)


def test_no_two_prompts_share_a_word_8_gram():
    texts = _turn_texts(_rows())
    pairs = shared_ngram_pairs(texts, N)
    assert pairs == [], [(texts[i][:50], texts[j][:50], gram) for i, j, gram in pairs[:5]]


def test_no_prompt_shares_a_word_8_gram_with_the_chitchat_training_data(chitchat_texts):
    texts = _turn_texts(_rows())
    overlap = ngram_overlap(texts, chitchat_texts, N)
    assert overlap.b_texts == len(chitchat_texts) and overlap.b_ngrams > 1_000_000  # the whole dataset was read
    assert overlap.a_ngrams > 2_000
    assert not overlap, overlap.describe(texts)


def test_no_prompt_shares_a_word_8_gram_with_the_other_prompt_files():
    others = [p for p in sorted(PROMPTS.glob("*.json*")) if p != BROAD]
    assert others  # instruct.jsonl at least
    other_texts = []
    for path in others:
        prompts, _ = load_prompts(str(path))  # every file there is a valid prompt file
        assert prompts
        raw = path.read_text()
        rows = (json.loads(raw) if raw.lstrip().startswith("[")
                else [json.loads(x) for x in raw.splitlines() if x.strip()])
        other_texts += [t for row in rows for t in _strings_of(row)]
    texts = _turn_texts(_rows())
    overlap = ngram_overlap(texts, other_texts, N)
    assert overlap.b_ngrams > 0 and not overlap, overlap.describe(texts)


def test_the_overlap_check_catches_a_planted_overlap(chitchat_texts):
    """The checks above can fail: 8 words of a chitchat message, re-cased and re-punctuated inside
    a prompt, are found; 7 are not an 8-gram; a copied clause inside the set is a near-duplicate."""
    source = next(t for t in chitchat_texts if len(t.split()) >= 12 and t.isascii())
    planted = " ".join(source.split()[2:10])
    texts = _turn_texts(_rows())
    doctored = texts[:5] + [f"Tell me more: {planted.upper()}!! please."] + texts[5:]
    found = ngram_overlap(doctored, chitchat_texts, N)
    assert found and all(5 in where for where in found.shared.values())
    assert not ngram_overlap(texts[:5] + [" ".join(source.split()[2:9])], chitchat_texts, N)

    copy = " ".join(texts[10].split()[:N])
    pairs = shared_ngram_pairs(texts[:20] + [f"Quick one. {copy}, thanks"], N)
    assert [(i, j) for i, j, _ in pairs] == [(10, 20)]


def test_ngram_overlap_counts_what_it_compared():
    overlap = ngram_overlap(["one two three four", "five six"], ["x one two three y", "two three four"], n=3)
    assert overlap.shared == {"one two three": [0], "two three four": [0]}
    assert (overlap.a_ngrams, overlap.b_texts, overlap.b_ngrams) == (2, 2, 4)
    with pytest.raises(ValueError):
        ngram_overlap(["a"], ["a"], n=0)
