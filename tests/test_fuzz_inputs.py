"""Fuzzed inputs (issue 24, item 5): the parsers of files users download or share never raise a traceback.

For each parser in tests/fuzz_inputs.py (recipe and overrides, chat rows, eval prompts, a dump's
manifest, sidecars, index and shards), hypothesis generates structured-but-wrong inputs and
checks the property: a well-formed result, a counted skip, or one `EyasError` line. The run is
bounded (a few seconds per parser) and derandomised, so CI sees the same inputs every time;
benchmarks/bench_fuzz_inputs.py runs the same checks on many more.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from fuzz_inputs import (
    ACCEPTED,
    GOOD_CHAT,
    PARSERS,
    REFUSED,
    SKIPPED,
    FileCase,
    RecipeCase,
    ShardCase,
    check_chat_rows,
    check_prompts,
    check_recipe,
    check_shards,
    small_dump,
)
from hypothesis import HealthCheck, given, settings

EXAMPLES = {"recipe": 60, "chat_rows": 80, "prompts": 80, "shards": 60}


def bounded(name: str):
    """The suite's settings: derandomised (the same inputs in every run), no deadline, no example database."""
    return settings(max_examples=EXAMPLES[name], derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def work() -> Path:
    with tempfile.TemporaryDirectory(prefix="eyas-fuzz-") as folder:
        yield Path(folder)


@bounded("recipe")
@given(case=PARSERS["recipe"][0])
def test_recipe_and_overrides_load_or_say_why_in_one_line(work, case):
    check_recipe(work, case)


@bounded("chat_rows")
@given(case=PARSERS["chat_rows"][0])
def test_chat_rows_are_kept_or_counted_as_skips(work, case):
    check_chat_rows(work, case)


@bounded("prompts")
@given(case=PARSERS["prompts"][0])
def test_prompt_rows_are_prompts_or_counted_as_skips(work, case):
    check_prompts(work, case)


@bounded("shards")
@given(case=PARSERS["shards"][0])
def test_a_damaged_dump_reads_back_as_written_or_is_refused_in_one_line(work, case):
    check_shards(work, case)


def test_the_small_dump_reads_back_whole(work):
    """The undamaged dump passes every check the fuzzed ones are held to (so a refusal above is the damage's)."""
    from eyas.data.shard_reader import ShardReader
    from eyas.data.shard_verify import verify

    dump = small_dump()
    check_shards(work, ShardCase("manifest.json", dump.files["manifest.json"], "bytes"))
    assert verify(work / "shards") == []
    assert len(ShardReader(work / "shards").lengths) == len(dump.codes) == 10


# Inputs the fuzzer found tracebacks on (or that reading the parsers showed), each now one line or a counted skip.
GOOD_LINE = json.dumps(GOOD_CHAT).encode()
FOUND = {
    "recipe": [
        (RecipeCase(b"run: {name: !!float x}", []), REFUSED),  # PyYAML's float(): ValueError
        (RecipeCase(b"run: {name: !!timestamp x}", []), REFUSED),  # AttributeError inside PyYAML
        (RecipeCase(b"run: {name: !!bool maybe}", []), REFUSED),  # KeyError inside PyYAML
        (RecipeCase(b"run: {seed: " + b"1" * 5000 + b"}", []), REFUSED),  # int() past 4300 digits: ValueError
        (RecipeCase(b"[" * 3000, []), REFUSED),  # RecursionError
        (RecipeCase(None, ["run.name=!!timestamp 2024-13-45"]), REFUSED),
        (RecipeCase(None, ["train.lr=" + "[" * 3000]), REFUSED),
        (RecipeCase(b"eval: {drafts: &a [*a, *a]}", []), REFUSED),  # accepted, then RecursionError saving it
        (RecipeCase(b'run: {name: "\\ud800"}', []), REFUSED),  # a lone surrogate: no path takes it
        (RecipeCase(b'run: {output_dir: "runs\\0x"}', []), REFUSED),  # a NUL: no path takes it
        (RecipeCase(b'run: {"a\\nb": 1}', []), REFUSED),  # the key's newline split the error line in two
        (RecipeCase(None, ["draft.kind=mtp", "draft.num_steps=4"]), ACCEPTED),
    ],
    "chat_rows": [
        (FileCase(".jsonl", b"1" * 5000 + b"\n" + GOOD_LINE), SKIPPED),  # ValueError from json.loads
        (FileCase(".jsonl", b"[" * 3000 + b"\n" + GOOD_LINE), SKIPPED),  # RecursionError from json.loads
        (FileCase(".jsonl", b'{"id": "\\ud800", "text": "hi"}\n' + GOOD_LINE), SKIPPED),  # id hashed by the split
        (FileCase(".json", b"[" * 3000), REFUSED),
        (FileCase(".json", b"[" + b"9" * 5000 + b"]"), REFUSED),
    ],
    "prompts": [
        (FileCase(".jsonl", b'{"prompt": "caf\xe9"}'), REFUSED),  # Latin-1: UnicodeDecodeError
        (FileCase(".jsonl", b"\xef\xbb\xbf" + b'{"prompt": "hi"}'), ACCEPTED),  # the BOM cost the first row
        (FileCase(".jsonl", '{"prompt": "a\u2028b"}\n{"prompt": "c\x85d"}'.encode()), ACCEPTED),  # splitlines()
        (FileCase(".jsonl", b'{"prompt": "\\ud800"}\n{"prompt": "hi"}'), SKIPPED),  # the tokenizer's error
        (FileCase(".jsonl", b'{"messages": [{"role": 5, "content": "x"}]}\n{"prompt": "hi"}'), SKIPPED),
        (FileCase(".jsonl", b"[" + b"1" * 5000 + b"]"), REFUSED),
        (FileCase(".jsonl", b"{" * 3000 + b"\n" + b'{"prompt": "hi"}'), SKIPPED),
    ],
}


def _manifest_with(edit) -> bytes:
    manifest = json.loads(small_dump().files["manifest.json"])
    edit(manifest)
    return json.dumps(manifest).encode()


def _set(path: tuple, value):
    def edit(doc):
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value
    return edit


SHARDS_FOUND = [
    (("manifest.json",), lambda: json.dumps([1, 2]).encode()),  # AttributeError: 'list' object has no attribute 'get'
    (("manifest.json",), lambda: _manifest_with(lambda m: m.pop("target_identity"))),  # KeyError
    (("manifest.json",), lambda: _manifest_with(_set(("shards", 0, "num_samples"), [0.5]))),  # TypeError
    (("manifest.json",), lambda: _manifest_with(_set(("features", "aux_hidden", "encodings"), [["fp8"]]))),
    (("manifest.json",), lambda: _manifest_with(_set(("features", "last_hidden"), [{"encoding": "bf16"}]))),
    (("manifest.json",), lambda: _manifest_with(_set(("shards", 1, "file"), "../manifest.json"))),
    (("manifest.json",), lambda: _manifest_with(_set(("features", "last_hidden", "encoding"), "fp8"))),  # no .scale
    (("manifest.json",), lambda: _manifest_with(_set(("features", "aux_hidden", "encodings", 0), "int4"))),  # fp8 codes
    (("manifest.json",), lambda: _manifest_with(lambda m: m["shards"].pop())),  # the index's shard 2: IndexError
    (("shard-00002.json",), lambda: json.dumps({**json.loads(small_dump().files["shard-00002.json"]),
                                               "num_tokens": [3]}).encode()),  # TypeError in header_problem
]


@pytest.mark.parametrize("parser, index", [(name, i) for name, cases in FOUND.items() for i in range(len(cases))])
def test_found_faults_stay_fixed(work, parser, index):
    case, outcome = FOUND[parser][index]
    check = {"recipe": check_recipe, "chat_rows": check_chat_rows, "prompts": check_prompts}[parser]
    assert check(work, case) == outcome


def _shard_header_with(shard: str, tensor: str, shape: list[int]) -> bytes:
    """The shard with one tensor's shape changed in its header, to another of the same byte count."""
    from fuzz_inputs import _header_split, _with_header

    header, rest = _header_split(small_dump().files[shard])
    header[tensor]["shape"] = shape
    return _with_header(header, rest)


SHARDS_FOUND += [  # a header edit that keeps the bytes: CRC-32 passes, then decoding broadcast [T, 8] x [T, 1, 1]
    (("shard-00001.safetensors",), lambda: _shard_header_with("shard-00001.safetensors", "aux_hidden.0.scale", [15, 1, 1])),
    (("shard-00001.safetensors",), lambda: _shard_header_with("shard-00001.safetensors", "last_hidden", [30, 4])),
]


@pytest.mark.parametrize("index", range(len(SHARDS_FOUND)))
def test_found_shard_faults_stay_fixed(work, index):
    (name,), data = SHARDS_FOUND[index]
    assert check_shards(work, ShardCase(name, data(), "json")) == (ACCEPTED if name.endswith(".json") and name != "manifest.json"
                                                                   else REFUSED)
