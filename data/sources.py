"""Reading chat data into one row shape, and the deterministic held-out split.

Every source becomes a list of rows `{"id": str, "messages": [{"role", "content"}, ...]}`
or, for plain text, `{"id": str, "text": str}`. Sources:

- `chitchat`: the 7,168 two-person conversations of the PyPI package `chitchat-dataset`
  (no network). The speaker who opens is `user`, the other `assistant`; consecutive
  messages of one speaker form one turn, joined by newlines.
- a `.jsonl` or `.json` file, rows in ShareGPT (`conversations` with `from`/`value`),
  OpenAI (`messages` with `role`/`content`) or plain `text` form;
- a `datasets` directory written by `save_to_disk`.

Rows that cannot be read are not dropped silently: `load_rows` returns them counted by
reason in a `Skips` record, which the prepare stage reports and writes to a file.

Bytes: files are read as UTF-8 (a leading BOM is dropped). A JSONL line that is not UTF-8 is a
counted skip (`not UTF-8`); a file that is binary (NUL bytes), or a .json document that is not
UTF-8, is one error naming the file and the offset.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.io import json_problem

CHITCHAT_INSTALL = "pip install --no-deps chitchat-dataset"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}
OPENAI_ROLES = ("system", "user", "assistant")
NOT_UTF8 = "not UTF-8"  # skip reason of a JSONL line whose bytes are not UTF-8 text
BOM = b"\xef\xbb\xbf"


@dataclass
class Skips:
    """Rows left out, counted by reason; `examples` keeps the first few per reason."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    truncated: int = 0  # rows kept, but cut to max_length (not skips; counted beside them)
    truncated_examples: list = field(default_factory=list)

    def add(self, reason: str, row_id: str, detail: str = "") -> None:
        self.counts[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < 20:
            self.examples[reason].append({"id": row_id, "detail": detail[:200]})

    def add_truncated(self, row_id: str, detail: str = "") -> None:
        self.truncated += 1
        if len(self.truncated_examples) < 20:
            self.truncated_examples.append({"id": row_id, "detail": detail[:200]})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.counts:
            return "no rows skipped"
        return ", ".join(f"{n} {reason}" for reason, n in self.counts.most_common())


def _chitchat_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"data.source 'chitchat' needs the package 'chitchat-dataset'; install it with: {CHITCHAT_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset.json"
    if not path.is_file():
        raise EyasError(f"'{path}' is missing; reinstall with: {CHITCHAT_INSTALL} --force-reinstall")
    return path


def chitchat_rows() -> list[dict]:
    """The chitchat conversations as user/assistant turns, in the package's order."""
    raw = json.loads(_chitchat_path().read_text())
    rows = []
    for conv_id, conv in raw.items():
        turns = conv.get("messages") or []
        first_sender = turns[0][0]["sender"] if turns and turns[0] else None
        messages = []
        for turn in turns:
            text = "\n".join(m["text"].strip() for m in turn if m.get("text", "").strip())
            if not text:
                continue
            role = "user" if turn[0]["sender"] == first_sender else "assistant"
            if messages and messages[-1]["role"] == role:  # one speaker twice in a row: one turn
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        rows.append({"id": f"chitchat-{conv_id}", "messages": messages})
    return rows


def chitchat_openings(count: int, max_chars: int = 400) -> list[dict]:
    """Prompt-only rows: the opening user turn of the first `count` chitchat conversations whose
    opening is under `max_chars` characters (what regeneration benchmarks and tests reply to)."""
    rows = []
    for row in chitchat_rows():
        user = next((m for m in row["messages"] if m["role"] == "user"), None)
        if user and len(user["content"]) < max_chars:
            rows.append({"id": str(len(rows)), "messages": [{"role": "user", "content": user["content"]}]})
        if len(rows) == count:
            break
    return rows


def normalize_row(row: Any, row_id: str, fmt: str = "auto") -> dict:
    """One raw row -> `{"id", "messages"}` or `{"id", "text"}`; ValueError says why it can't be."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    row_id = str(row.get("id", row_id))
    _check_unicode(row_id, "'id'")  # row ids are hashed for the held-out split and written to arrow files
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in row else "openai" if "messages" in row else "text" if "text" in row else ""
        if not fmt:
            raise ValueError("row has none of the keys 'conversations', 'messages', 'text'")
    if fmt == "text":
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("'text' is missing or empty")
        _check_unicode(text, "'text'")
        return {"id": row_id, "text": text}
    key, role_key, content_key = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    turns = row.get(key)
    if not isinstance(turns, list):
        raise ValueError(f"'{key}' is missing or not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise ValueError(f"a turn lacks '{role_key}' or '{content_key}'")
        raw_role = str(turn[role_key]).lower()
        role = SHAREGPT_ROLES.get(raw_role) if fmt == "sharegpt" else (raw_role if raw_role in OPENAI_ROLES else None)
        if role is None:
            raise ValueError(f"unknown role '{turn[role_key]}'")
        if not isinstance(turn[content_key], str):
            raise ValueError(f"'{content_key}' of a turn is not a string")
        _check_unicode(turn[content_key], f"'{content_key}' of a turn")
        messages.append({"role": role, "content": turn[content_key]})
    return {"id": row_id, "messages": messages}


def _check_unicode(text: str, what: str) -> None:
    """JSON escapes can smuggle in lone surrogates (\\ud800), which no tokenizer or arrow file takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} holds a lone surrogate (\\u{ord(text[exc.start]):04x}), not valid Unicode") from None


def _refuse_binary(path: Path, head: bytes) -> None:
    nul = head.find(b"\x00")
    if nul >= 0:
        raise EyasError(f"data file '{path}' is binary (NUL byte at offset {nul}), not UTF-8 JSON text; give a "
                        ".jsonl/.json file of rows (convert UTF-16 files to UTF-8)")


def _read_file_rows(path: Path, skips: Skips) -> Iterable[tuple[str, Any]]:
    try:
        f = path.open("rb")
    except OSError as exc:
        raise EyasError(f"data file '{path}' cannot be read ({exc.strerror or exc})") from None
    with f:
        _refuse_binary(path, f.read(8192))
        f.seek(0)
        if path.suffix == ".jsonl":
            for lineno, raw in enumerate(f, 1):
                if lineno == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM):]
                row_id = f"{path.name}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    skips.add(NOT_UTF8, row_id, f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}")
                    continue
                if not line.strip():
                    continue
                try:
                    yield row_id, json.loads(line)
                except (ValueError, RecursionError) as exc:  # also an int past 4300 digits, nesting past the stack
                    skips.add("malformed JSON line", row_id, json_problem(exc, where=False))
            return
        data = f.read()
    if data.startswith(BOM):
        data = data[len(BOM):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise EyasError(f"data file '{path}' is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}, "
                        f"line {line}); save it as UTF-8, or as JSONL, where such a row is skipped and "
                        "counted") from None
    try:
        rows = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise EyasError(f"data file '{path}' is not valid JSON ({json_problem(exc)}); "
                        "use a JSON list of rows or JSONL, one row per line") from None
    if isinstance(rows, dict):
        rows = rows.get("data") or rows.get("rows") or [rows]
    if not isinstance(rows, list):
        raise EyasError(f"data file '{path}' holds a JSON {type(rows).__name__}, not a list of rows; "
                        "use a JSON list of rows or JSONL, one row per line")
    for i, row in enumerate(rows):
        yield f"{path.name}:{i}", row


def _read_rows(source: str, skips: Skips) -> Iterable[tuple[str, Any]]:
    if source == "chitchat":
        for row in chitchat_rows():
            yield row["id"], row
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise EyasError(f"data.source '{source}' does not exist; give 'chitchat', a .jsonl/.json file or a datasets directory")
    if path.is_dir():
        from datasets import load_from_disk

        try:
            ds = load_from_disk(str(path))
        except Exception as exc:  # datasets raises several types for a folder it can't read
            raise EyasError(f"data.source '{source}' is a folder but not a saved `datasets` dataset ({exc})") from None
        if hasattr(ds, "keys"):  # a DatasetDict: take the train split, else the first
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        for i, row in enumerate(ds):
            yield f"{path.name}:{i}", row
        return
    if path.suffix not in (".jsonl", ".json"):
        raise EyasError(f"data.source '{source}' must be a .jsonl or .json file (or 'chitchat', or a datasets directory)")
    yield from _read_file_rows(path, skips)


def load_rows(source: str, fmt: str = "auto", max_samples: int = 0) -> tuple[list[dict], Skips]:
    """Read and normalise a source; malformed rows are counted in the returned Skips."""
    skips = Skips()
    rows = []
    for row_id, raw in _read_rows(source, skips):
        try:
            rows.append(normalize_row(raw, row_id, fmt))
        except ValueError as exc:
            skips.add("malformed row", row_id, str(exc))
            continue
        if max_samples and len(rows) >= max_samples:
            break
    if not rows:
        raise EyasError(f"data.source '{source}' gave no usable rows ({skips.summary()}); check its format")
    return rows, skips


def first_turns(rows: list[dict], max_turns: int) -> list[dict]:
    """Rows cut after their `max_turns`-th assistant turn (0: unchanged); text rows pass through."""
    if not max_turns:
        return rows
    out = []
    for row in rows:
        messages, replies = [], 0
        for message in row.get("messages") or []:
            if replies >= max_turns:
                break
            messages.append(message)
            replies += message["role"] == "assistant"
        out.append(dict(row, messages=messages) if messages else row)
    return out


def is_heldout(row_id: str, fraction: float, seed: int = 0) -> bool:
    """Deterministic split by conversation id: stable across runs, machines and max_samples."""
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(rows: list[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout), split by conversation so no conversation is in both."""
    train, heldout = [], []
    for row in rows:
        (heldout if is_heldout(row["id"], fraction, seed) else train).append(row)
    return train, heldout
