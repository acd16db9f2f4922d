"""Structured-but-wrong inputs for the parsers eyas applies to files users download or share, and the
property each parser keeps (issue 24, item 5).

Shared by tests/test_fuzz_inputs.py (a bounded, derandomised run in the fast suite) and
benchmarks/bench_fuzz_inputs.py (a longer run that counts inputs and tracebacks). The parsers:

- `recipe`: a recipe file and `section.key=value` overrides (`eyas.config.load_recipe`);
- `chat_rows`: a JSONL or JSON file of ShareGPT, OpenAI or text rows (`eyas.data.sources.load_rows`);
- `prompts`: an eval prompt file, MT-bench turns, OpenAI messages or bare prompts (`eyas.eval.prompts.load_prompts`);
- `shards`: a real small dump with one file damaged: the manifest, a sidecar, the index, a shard's
  bytes or its safetensors header (`ShardReader` opening it and reading every sample, the trainer's
  `check_shards_fit`, `eyas verify`, and the dump's own `check_shard` on resume).

The property, for every input: the parser succeeds with a well-formed result (what a later stage
relies on: UTF-8 text, known roles, every row either kept or counted as a skip, the very samples
that were written), or raises `EyasError` with a one-line message. Any other exception, or an
`EyasError` over more than one line, is a fault. Inputs are generated from what the parsers
expect, then made wrong: valid YAML/JSON of the wrong shapes and types, wrong nesting,
huge/negative numbers, NaN, lone surrogates, truncated and bit-flipped bytes, tagged YAML.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from hypothesis import strategies as st

from eyas.config import absolute_paths, load_recipe, save_resolved
from eyas.errors import EyasError
from eyas.recipe_docs import recipe_keys
from eyas.recipe_schema import CHOICES, Recipe

REPO = Path(__file__).resolve().parent.parent
BOM = b"\xef\xbb\xbf"

# ----------------------------------------------------------------------------- building blocks

SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.one_of(st.text(max_size=12), st.text(st.one_of(st.characters(), SURROGATE), max_size=6),
                 st.sampled_from(["", " ", "\x00", "a\nb", "\u2028", "\ufeff", "\x1c", "nan", "-1", "1e999", "../../x",
                                  "/", "~", "yes", "null", "[", "{", "\ud800", "é", "𝕏", "user", "assistant"]))
INTEGER = st.one_of(st.integers(-3, 12), st.sampled_from([-(2**63) - 1, -(2**31), 2**31, 2**63, 10**30, 10**300]),
                    st.integers())
NUMBER = st.one_of(INTEGER, st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, -0.0, 1e-310]))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JSON_VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(TEXT, inner, max_size=4)), max_leaves=10)

# Byte fragments that break readers in known ways: deep nesting, numbers past int()'s digit limit,
# BOMs and NULs, separators that str.splitlines() splits on but JSON strings may hold, a lone surrogate escape.
FRAGMENTS = [b"[" * 3000, b'{"a":' * 1500, b"1" * 5000, b"\x00", b"\xff\xfe", BOM, b"\r", b"\n", b'"\\ud800"',
             b"NaN", b"-Infinity", b"1e999", "\u2028".encode(), b"\x1c", b"\x85", b"\xc3", b"{}", b"[]", b"null", b'"',
             b"\\", b"\t"]


@st.composite
def mutated(draw: Callable, data: bytes, focus: int | None = None) -> bytes:
    """`data` truncated, bit-flipped, spliced or cut (positions drawn within the first `focus` bytes half the time)."""
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "overwrite", "cut", "duplicate"]))
    top = len(data) if focus is None else min(focus, len(data))
    at = draw(st.one_of(st.integers(0, max(top, 0)), st.integers(0, len(data))))
    if kind == "truncate":
        return data[:at]
    if kind == "flip" and data:
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            position = min(draw(st.one_of(st.just(at), st.integers(0, len(data) - 1))), len(data) - 1)
            out[position] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "insert":
        return data[:at] + draw(st.one_of(st.sampled_from(FRAGMENTS), st.binary(min_size=1, max_size=16))) + data[at:]
    span = draw(st.integers(1, 64))
    if kind == "overwrite":
        return data[:at] + draw(st.binary(min_size=span, max_size=span)) + data[at + span:]
    if kind == "cut":
        return data[:at] + data[at + span:]
    return data[:at + span] + data[at:]


def json_bytes(value: Any, ascii_only: bool) -> bytes:
    """JSON as a careless writer leaves it: NaN allowed, lone surrogates written raw when not escaped."""
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


def _nodes(doc: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every node of a JSON document (the root is ())."""
    found = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _nodes(value, path + (key,))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += _nodes(value, path + (i,))
    return found


def _near(value: Any) -> st.SearchStrategy:
    """Values a damaged file plausibly holds instead of `value`: its neighbours, another type, any JSON."""
    if isinstance(value, bool):
        return st.sampled_from([not value, 1, "true", None])
    if isinstance(value, int):
        return st.sampled_from([value + 1, value - 1, -value, 0, -1, 2**63, 10**30, float(value), str(value), None])
    if isinstance(value, str):
        return st.sampled_from(["", value[:-1], value + "x", value.upper(), "../manifest.json", "/etc/hostname",
                                "shard-00001.safetensors", "index.safetensors", "fp8", "int4", "bf17", "I64", "F8_E4M3"])
    if isinstance(value, list):
        return st.sampled_from([value[:-1], value + value[-1:], [str(v) for v in value], {"0": value}, []])
    if isinstance(value, dict):
        return st.sampled_from([list(value.values()), {}, {k: None for k in value}])
    return JSON_VALUE


@st.composite
def json_edited(draw: Callable, doc: Any) -> Any:
    """`doc` with one to three nodes replaced (by a neighbour or any JSON), deleted or wrapped in a list."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_nodes(doc)))
        if not path:
            doc = draw(st.one_of(_near(doc), JSON_VALUE))
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        action = draw(st.sampled_from(["near", "any", "delete", "wrap"]))
        if action == "delete":
            del parent[key]
        elif action == "wrap":
            parent[key] = [parent[key]]
        else:
            parent[key] = draw(_near(parent[key]) if action == "near" else JSON_VALUE)
    return doc


# What a check returns: the input was read (whole, or with rows counted as skips), or refused in one line.
ACCEPTED, SKIPPED, REFUSED = "accepted", "accepted with counted skips", "refused in one line"


def _one_line(exc: EyasError) -> None:
    message = str(exc)
    assert message and "\n" not in message and "\r" not in message, f"EyasError over more than one line: {message!r}"


def _encodable(value: str) -> bool:
    """UTF-8 encodable (no lone surrogate): what a tokenizer and an arrow file take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path_text(value: str) -> bool:
    """Text a path can hold: UTF-8 encodable, without NUL."""
    return _encodable(value) and "\x00" not in value


# ----------------------------------------------------------------------------- recipes

SECTIONS = {f.name: typing.get_type_hints(Recipe)[f.name] for f in dataclasses.fields(Recipe)}
# Values each recipe key plausibly takes, wrong ones among them: choices, loss mixes, shapes, categories.
WORDS = [w for choices in CHOICES.values() for w in choices] + [
    "forward_kl:0.9,ce:0.1", "ce:-1", "ce:nan", "lk:1e999", "ce:0", "forward_kl,", ":", "chain:5", "tree:[[0]]",
    "dynamic:depth=6,topk=8,nodes=32", "truncated:2", "mixture:0.5", "heldout", "chitchat", "none", "smollm2-135m-instruct"]
LIST_VALUES = st.one_of(st.lists(st.one_of(INTEGER, TEXT, NUMBER), max_size=4), st.lists(JSON_VALUE, max_size=3),
                        st.sampled_from([[0.9, 0.95], [float("nan"), 0.5], [2, 4, 5], [-1, 0, 99], ["writing"],
                                         [{"mine": "a system prompt"}], [{"x": {"system": 1}}], [{"a": "b", "c": "d"}]]))
# YAML that PyYAML itself trips on: tagged values its constructors cannot build, recursion, aliases, merge keys.
NASTY_YAML = ["run: {name: !!float x}", "run: {seed: !!int x}", "run: {name: !!timestamp x}", "run: {seed: !!int 0b2}",
              "run: {name: !!timestamp 2024-13-45}", "run: {name: !!bool maybe}", "run: {seed: " + "1" * 5000 + "}",
              "[" * 3000, "? " + "[" * 3000, "train: {betas: &a [*a]}", "eval: {drafts: &a [*a, *a]}",
              "run: !!python/object/apply:os.system ['true']", "run: {name: !!binary aGVsbG8=}", "--- a\n--- b",
              "run: {name: 2024-01-01}", "train: {<<: {lr: 1.0}}", "run:\n\tname: x", "%YAML 9.9\n---\nrun: {}",
              "run: {seed: 190:20:30}", "a: &a [x, x]\nb: &b [*a, *a]", "run: {name: !!set {a}}", "\ufeffrun: {}",
              "run: {name: \"\\ud800\"}", "run: {output_dir: \"a\\0b\"}", "data: {source: \"\\x00\"}", "run: {\"a\\nb\": 1}"]


def _typed_value(annotation: type) -> st.SearchStrategy:
    right = {int: INTEGER, float: st.one_of(NUMBER, st.integers(-3, 3)), bool: st.booleans(),
             str: st.one_of(st.sampled_from(WORDS), TEXT), list: LIST_VALUES}[annotation]
    return st.one_of(right, right, right, JSON_VALUE)


KEYS = recipe_keys()  # every section's keys and every kind's own


@st.composite
def recipe_documents(draw: Callable) -> Any:
    """A recipe mapping: real sections and keys (a few unknown), values of the right type or not."""
    doc: dict = {}
    for name in draw(st.lists(st.one_of(st.sampled_from(list(SECTIONS)), TEXT), max_size=5, unique=True)):
        cls = SECTIONS.get(name)
        if cls is None or draw(st.integers(0, 9)) == 9:
            doc[name] = draw(JSON_VALUE)
            continue
        hints = {dotted.split(".")[1]: hint for dotted, hint in KEYS.items() if dotted.startswith(f"{name}.")}
        keys = draw(st.lists(st.one_of(st.sampled_from(list(hints)), TEXT), max_size=4, unique=True))
        doc[name] = {key: draw(_typed_value(hints[key]) if key in hints else JSON_VALUE) for key in keys}
    return doc


@st.composite
def recipe_texts(draw: Callable) -> bytes:
    """A recipe file's bytes: a shipped recipe (as it is, or damaged), a generated mapping as YAML, or nasty YAML."""
    source = draw(st.sampled_from(["shipped", "shipped", "damaged", "generated", "generated", "nasty"]))
    if source in ("shipped", "damaged"):
        text = draw(st.sampled_from(sorted((REPO / "recipes").glob("*.yaml")))).read_text()
    elif source == "generated":
        text = yaml.safe_dump(draw(recipe_documents()), allow_unicode=draw(st.booleans()))
    else:
        text = draw(st.sampled_from(NASTY_YAML))
    data = text.encode("utf-8", "surrogatepass")
    return draw(mutated(data)) if source == "damaged" or draw(st.integers(0, 5)) == 5 else data




@st.composite
def overrides(draw: Callable) -> str:
    """One `section.key=value` string: mostly a real key with a value of its type or not, sometimes malformed."""
    dotted = draw(st.sampled_from(list(KEYS)))
    value = draw(st.one_of(_typed_value(KEYS[dotted]).map(lambda v: json.dumps(v, ensure_ascii=False, allow_nan=True)),
                           st.sampled_from(WORDS), st.sampled_from(NASTY_YAML), TEXT))
    if draw(st.integers(0, 9)) < 9:  # hypothesis draws small integers most often: 9 is the rare case
        return f"{dotted}={value}"
    dotted = draw(st.one_of(st.sampled_from(["a.b.c", ".", "train.", ".lr", "train", "", "x.y", "train.lr.x"]), TEXT))
    return draw(st.sampled_from([f"{dotted}={value}", dotted, f"={value}", f"{dotted}=={value}"]))


@dataclass
class RecipeCase:
    text: bytes | None  # None: no recipe file (defaults)
    overrides: list[str]


RECIPE_CASES = st.builds(RecipeCase, st.one_of(st.none(), recipe_texts()), st.lists(overrides(), max_size=3))


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def check_recipe(work: Path, case: RecipeCase) -> str:
    """A recipe loads, or one line says why; a loaded one is usable text and its saved copy loads the same."""
    path = None
    if case.text is not None:
        path = work / "recipe.yaml"
        path.write_bytes(case.text)
    try:
        recipe = load_recipe(path, list(case.overrides))
    except EyasError as exc:
        _one_line(exc)
        return REFUSED
    bad = [s for s in _strings(recipe.to_dict()) if not _path_text(s)]
    assert not bad, f"a loaded recipe holds text no path or tokenizer takes: {bad[0]!r}"
    saved = load_recipe(save_resolved(recipe, work / "saved"))
    dump = lambda r: yaml.safe_dump(r.to_dict())  # noqa: E731 - text, so a NaN inside a list compares equal
    assert dump(saved) == dump(absolute_paths(recipe)), "the saved recipe.yaml loads as another recipe"
    return ACCEPTED


# ----------------------------------------------------------------------------- chat rows

ROLES = ["human", "user", "gpt", "assistant", "system", "chatgpt", "bing", "bard", "model", "tool", "function",
         "Human", "USER", ""]


@st.composite
def chat_rows(draw: Callable) -> Any:
    """A ShareGPT, OpenAI or text row with its keys present, missing or of the wrong type, or any JSON."""
    kind = draw(st.sampled_from(["sharegpt", "openai", "text", "any"]))
    if kind == "any":
        return draw(JSON_VALUE)
    if kind == "text":
        row = {"text": draw(st.one_of(TEXT, TEXT, JSON_VALUE))}
    else:
        key, role_key, content_key = ("conversations", "from", "value") if kind == "sharegpt" else ("messages", "role", "content")
        turn = st.one_of(st.fixed_dictionaries({role_key: st.one_of(st.sampled_from(ROLES), JSON_VALUE),
                                                content_key: st.one_of(TEXT, TEXT, JSON_VALUE)}),
                         st.dictionaries(st.sampled_from([role_key, content_key, "name"]), JSON_VALUE, max_size=3),
                         JSON_VALUE)
        row = {key: draw(st.one_of(st.lists(turn, max_size=4), st.lists(turn, max_size=4), JSON_VALUE))}
    if draw(st.booleans()):
        row["id"] = draw(JSON_VALUE)
    if draw(st.integers(0, 4)) == 4:
        row[draw(TEXT)] = draw(JSON_VALUE)
    return row


@dataclass
class FileCase:
    suffix: str  # .jsonl or .json
    data: bytes
    fmt: str = "auto"


@st.composite
def row_files(draw: Callable, rows: st.SearchStrategy, good: dict) -> FileCase:
    """A file of rows (`good`, a row the reader keeps, among them half the time): JSONL (lines damaged one by one,
    CRLF or not, a BOM or not) or one JSON document."""
    suffix = draw(st.sampled_from([".jsonl", ".json"]))
    ascii_only = draw(st.integers(0, 3)) < 3  # else lone surrogates are written raw: not UTF-8
    drawn = draw(st.lists(rows, min_size=1, max_size=6))
    if draw(st.booleans()):
        drawn.insert(draw(st.integers(0, len(drawn))), good)
    if suffix == ".jsonl":
        lines = []
        for row in drawn:
            line = json_bytes(row, ascii_only)
            lines.append(draw(mutated(line)) if draw(st.integers(0, 3)) == 3 else line)
        data = draw(st.sampled_from([b"\n", b"\r\n"])).join(lines) + draw(st.sampled_from([b"\n", b"", b"\n\n"]))
    else:
        listed = drawn
        document = draw(st.sampled_from(["list", "data", "rows", "one", "any"]))
        value = {"list": listed, "data": {"data": listed}, "rows": {"rows": listed}, "one": listed[0],
                 "any": draw(JSON_VALUE)}[document]
        data = json_bytes(value, ascii_only)
    if draw(st.integers(0, 5)) == 5:
        data = BOM + data
    if draw(st.integers(0, 3)) == 3:
        data = draw(mutated(data))
    return FileCase(suffix, data)


GOOD_CHAT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
CHAT_CASES = st.builds(lambda case, fmt: dataclasses.replace(case, fmt=fmt), row_files(chat_rows(), GOOD_CHAT),
                       st.sampled_from(["auto", "auto", "sharegpt", "openai", "text"]))


def jsonl_rows(data: bytes) -> int:
    """Rows of a JSONL file as the readers count them: lines (split at \\n only) that are not blank once decoded."""
    if data.startswith(BOM):
        data = data[len(BOM):]
    count = 0
    for line in data.split(b"\n"):
        try:
            count += bool(line.decode("utf-8").strip())
        except UnicodeDecodeError:
            count += 1  # a row, counted as a skip
    return count


def json_rows(data: bytes) -> int:
    """Rows of a JSON document as `load_rows` takes them: a list, `data`/`rows` of an object, else the object."""
    rows = json.loads(data.decode("utf-8-sig"))
    if isinstance(rows, dict):
        rows = rows.get("data") or rows.get("rows") or [rows]
    return len(rows)


def check_chat_rows(work: Path, case: FileCase) -> str:
    """Every row is kept in eyas's shape or counted as a skip; a file that cannot be read is one line."""
    from eyas.data.sources import OPENAI_ROLES, load_rows

    path = work / f"rows{case.suffix}"
    path.write_bytes(case.data)
    try:
        rows, skips = load_rows(str(path), case.fmt)
    except EyasError as exc:
        _one_line(exc)
        return REFUSED
    for row in rows:
        assert isinstance(row["id"], str) and _encodable(row["id"]), row
        if "text" in row:
            assert isinstance(row["text"], str) and row["text"].strip() and _encodable(row["text"]), row
        else:
            assert all(m["role"] in OPENAI_ROLES and isinstance(m["content"], str) for m in row["messages"]), row
            assert all(_encodable(m["content"]) for m in row["messages"]), row
    expected = jsonl_rows(case.data) if case.suffix == ".jsonl" else json_rows(case.data)
    assert len(rows) + skips.total == expected, f"{expected} rows, {len(rows)} kept and {skips.total} skipped ({skips.summary()})"
    return ACCEPTED if not skips.total else SKIPPED


# ----------------------------------------------------------------------------- eval prompts


@st.composite
def prompt_rows(draw: Callable) -> Any:
    """An MT-bench, OpenAI-messages or bare-prompt row, right or wrong, or any JSON."""
    kind = draw(st.sampled_from(["turns", "messages", "prompt", "any"]))
    if kind == "any":
        return draw(JSON_VALUE)
    if kind == "turns":
        row = {"turns": draw(st.one_of(st.lists(TEXT, max_size=3), JSON_VALUE))}
    elif kind == "messages":
        message = st.one_of(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(ROLES), JSON_VALUE),
                                                   "content": st.one_of(TEXT, TEXT, JSON_VALUE)}), JSON_VALUE)
        row = {"messages": draw(st.one_of(st.lists(message, max_size=4), JSON_VALUE))}
    else:
        row = {"prompt": draw(st.one_of(TEXT, JSON_VALUE))}
    for key in draw(st.lists(st.sampled_from(["category", "question_id", "id"]), max_size=2, unique=True)):
        row[key] = draw(JSON_VALUE)
    return row


PROMPT_CASES = row_files(prompt_rows(), {"turns": ["hi", "and then?"], "category": "chat"})


def check_prompts(work: Path, case: FileCase) -> str:
    """Every row is a prompt of user/system/assistant text or a counted skip; a file it cannot read is one line."""
    from eyas.eval.prompts import load_prompts

    path = work / f"prompts{case.suffix}"
    path.write_bytes(case.data)
    try:
        prompts, skipped = load_prompts(str(path))
    except EyasError as exc:
        _one_line(exc)
        return REFUSED
    for prompt in prompts:
        assert prompt.messages and prompt.messages[-1]["role"] == "user", prompt
        assert all(isinstance(m["role"], str) and isinstance(m["content"], str) and _encodable(m["content"])
                   for m in prompt.messages), prompt
        assert all(isinstance(f, str) and _encodable(f) for f in prompt.followups), prompt
        assert isinstance(prompt.id, str) and isinstance(prompt.category, str), prompt
    text = case.data.decode("utf-8-sig")
    if text.lstrip().startswith("["):
        rows = json.loads(text)
        expected = len(rows) if isinstance(rows, list) else 1
    else:
        expected = jsonl_rows(case.data)
    assert len(prompts) + sum(skipped.values()) == expected, f"{expected} rows, {len(prompts)} prompts, skipped {skipped}"
    return ACCEPTED if not skipped else SKIPPED


# ----------------------------------------------------------------------------- shards

HIDDEN, PLAN, IDENTITY = 8, "fuzz-plan", "synthetic"
LENGTHS = [3, 7, 2, 9, 4, 6, 5, 8, 3, 5]


@dataclass
class Dump:
    """A real small dump (three shards, fp8 fused layers with scales, bf16 last hidden, the last shard
    without per-sample checksums as older dumps wrote it): its files' bytes and every sample as stored."""

    files: dict[str, bytes]
    codes: list[dict[str, torch.Tensor]]


_DUMP: list[Dump] = []


def small_dump() -> Dump:
    """Written once per process (a fraction of a second), then copied for each case."""
    if _DUMP:
        return _DUMP[0]
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save

    from eyas.data.dump import finalize_split
    from eyas.data.shard_format import CHECKSUM, SCHEMA_VERSION, encode
    from eyas.data.shard_reader import ShardReader
    from eyas.data.shard_writer import write_shard

    folder = Path(tempfile.mkdtemp(prefix="eyas-fuzz-dump-"))
    g = torch.Generator().manual_seed(0)
    cuts = [0, 4, 7, len(LENGTHS)]
    for k in range(3):
        lengths = LENGTHS[cuts[k]:cuts[k + 1]]
        tokens = sum(lengths)
        tensors = {"input_ids": torch.randint(0, 300, (tokens,), generator=g).to(torch.uint16),
                   "loss_mask": (torch.arange(tokens) % 2).to(torch.uint8),
                   "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
                   "sample_index": torch.arange(cuts[k], cuts[k + 1], dtype=torch.int64)}
        for j in range(3):
            for suffix, t in encode(torch.randn(tokens, HIDDEN, generator=g), "fp8").items():
                tensors[f"aux_hidden.{j}{suffix}"] = t
        tensors["last_hidden"] = encode(torch.randn(tokens, HIDDEN, generator=g), "bf16")[""]
        record = write_shard(folder, k, tensors, {"schema_version": SCHEMA_VERSION, "plan": PLAN, "shard": k})
        if k == 2:  # as written before per-sample checksums: the reader hashes it whole at first read
            path = folder / record["file"]
            with safe_open(str(path), "pt") as f:
                kept, metadata = {n: f.get_tensor(n) for n in f.keys() if n != CHECKSUM}, f.metadata()
            payload = save(kept, metadata=metadata)
            path.write_bytes(payload)
            record.update(bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
            path.with_suffix(".json").write_text(json.dumps(record))
    header = {"schema_version": SCHEMA_VERSION, "target_identity": IDENTITY, "identity_scheme": 2, "target_path": "none",
              "hidden_size": HIDDEN, "layers": [1, 2, 3], "encoding": "fp8", "draft_kind": "eagle3",
              "features": {"aux_hidden": {"layers": [1, 2, 3], "encodings": ["fp8"] * 3, "shape": [3 * HIDDEN]},
                           "last_hidden": {"encoding": "bf16", "shape": [HIDDEN]}}}
    finalize_split(folder, 3, header, wait=False, plan=PLAN)
    reader = ShardReader(folder, expect_identity=IDENTITY)
    codes = [reader.codes(i) for i in range(len(reader))]
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    shutil.rmtree(folder)
    _DUMP.append(Dump(files, codes))
    return _DUMP[0]


JSON_FILES = ("manifest.json", "shard-00000.json", "shard-00002.json")
BINARY_FILES = ("index.safetensors", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors")


@dataclass
class ShardCase:
    file: str
    data: bytes
    how: str  # bytes (damaged as bytes), json (a JSON file edited), header (a shard's safetensors header edited)


def _header_split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(header: Any, rest: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + rest


@st.composite
def shard_cases(draw: Callable) -> ShardCase:
    """One file of the small dump damaged: as bytes, as edited JSON, or as an edited safetensors header
    (its length prefix kept right, so the damage reaches past the first check)."""
    files = small_dump().files
    how = draw(st.sampled_from(["bytes", "json", "header", "metadata"]))
    if how == "json":
        name = draw(st.sampled_from(JSON_FILES))
        return ShardCase(name, json_bytes(draw(json_edited(json.loads(files[name]))), True), how)
    name = draw(st.sampled_from(JSON_FILES + BINARY_FILES if how == "bytes" else BINARY_FILES))
    data = files[name]
    if how == "bytes":
        return ShardCase(name, draw(mutated(data, focus=8 + int.from_bytes(data[:8], "little"))), how)
    header, rest = _header_split(data)
    if how == "metadata" and "__metadata__" in header:
        inner = json.loads(header["__metadata__"].get("eyas", "{}"))
        header["__metadata__"]["eyas"] = json.dumps(draw(json_edited(inner)), allow_nan=True)
    else:
        header = draw(json_edited(header))
    return ShardCase(name, _with_header(header, rest), how)


SHARD_CASES = shard_cases()


def check_shards(work: Path, case: ShardCase) -> str:
    """Opening the damaged dump and reading every sample gives the samples as written, or one line; so do
    the trainer's fit check, `eyas verify` and the dump's resume check (never an exception of another kind)."""
    from eyas.data.shard_reader import ShardReader
    from eyas.data.shard_verify import verify
    from eyas.data.shard_writer import check_shard
    from eyas.train.data import check_shards_fit

    dump = small_dump()
    folder = work / "shards"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, data in dump.files.items():
        (folder / name).write_bytes(case.data if name == case.file else data)
    outcome = ACCEPTED
    try:
        reader = ShardReader(folder, expect_identity=IDENTITY)
        check_shards_fit(reader.manifest, "eagle3", HIDDEN, [], folder)
        got = [reader.codes(i) for i in range(len(reader))]
        for i in range(len(reader)):
            reader.sample(i)
    except EyasError as exc:
        _one_line(exc)
        outcome = REFUSED
    else:
        if case.file in BINARY_FILES:  # damaged bytes read back without an error must be the bytes written
            assert len(got) == len(dump.codes), f"{len(got)} samples read, {len(dump.codes)} written"
            for read, written in zip(got, dump.codes):
                assert read.keys() == written.keys() and all(torch.equal(read[k], written[k]) for k in read), \
                    f"a sample of the damaged {case.file} was read back changed, without an error"
    try:
        problems = verify(folder)
        assert all(isinstance(p, str) and "\n" not in p for p in problems), problems
    except EyasError as exc:
        _one_line(exc)
    for index in range(3):
        for full in (False, True):
            problem = check_shard(folder, index, full=full, expect_plan=PLAN)
            assert isinstance(problem, str), problem
            if not problem and case.file == f"shard-{index:05d}.json":
                _check_sidecar(json.loads(case.data), index)
    return outcome


def _check_sidecar(record: Any, index: int) -> None:
    """A sidecar the dump trusts holds what `finalize_split` sums and indexes."""
    assert isinstance(record, dict) and record.get("file") == f"shard-{index:05d}.safetensors", record
    for key in ("bytes", "num_samples", "num_tokens", "num_loss_tokens"):
        assert isinstance(record.get(key), int) and not isinstance(record.get(key), bool) and record[key] >= 0, (key, record)


# ----------------------------------------------------------------------------- the table

PARSERS: dict[str, tuple[st.SearchStrategy, Callable[[Path, Any], str]]] = {
    "recipe": (RECIPE_CASES, check_recipe),
    "chat_rows": (CHAT_CASES, check_chat_rows),
    "prompts": (PROMPT_CASES, check_prompts),
    "shards": (SHARD_CASES, check_shards),
}


def describe(exc: BaseException) -> str:
    """One line for a fault: the exception type, where it was raised, and its message."""
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    first = (str(exc).splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}{where}: {first}"

