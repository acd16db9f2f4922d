"""Eval prompts: MT-bench / Spec-Bench JSONL, OpenAI messages, or the recipe's held-out split.

Accepted rows (JSONL, one object per line, or a JSON list of objects):
  {"turns": ["first user turn", ...], "category": "writing"}   MT-bench / Spec-Bench: each turn
                                                                is a prompt; turn k > 1 follows the
                                                                target's own greedy answers to the
                                                                turns before it (as MT-bench runs)
  {"messages": [{"role": "user", "content": "..."}, ...]}      OpenAI: the conversation up to its
                                                                last user turn
  {"prompt": "..."}                                              a bare user prompt
An optional "category" (or "question_id"/"id") is kept for the per-category breakdown.
Held-out rows (`eyas prepare`'s `heldout` split) carry `messages`, cut the same way.
Prompts are rendered with the target's chat template and its generation prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.data.prepare import load_prepared
from eyas.errors import EyasError


@dataclass
class Prompt:
    id: str
    category: str
    messages: list[dict]
    followups: list[str] = field(default_factory=list)  # later user turns, asked after the target's answers
    turn: int = 1


def next_turn(prompt: Prompt, answer: str) -> Prompt:
    """The prompt of the following turn: this one's messages, the target's answer, the next user turn."""
    messages = prompt.messages + [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": prompt.followups[0]}]
    return Prompt(prompt.id, prompt.category, messages, prompt.followups[1:], prompt.turn + 1)


def _text(value: Any) -> bool:
    """A string a tokenizer takes: UTF-8 encodable (JSON escapes can smuggle in a lone surrogate, \\ud800)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _until_last_user(messages: list[dict]) -> list[dict] | None:
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return None
    return [{"role": m["role"], "content": m["content"]} for m in messages[: last + 1]]


def prompt_from_row(row: Any, index: int, default_category: str = "all") -> Prompt | None:
    """One prompt from a row in any accepted form; None when the row has no user prompt."""
    if not isinstance(row, dict):
        return None
    row_id = str(row.get("question_id", row.get("id", index)))
    category = str(row.get("category") or default_category)
    messages, followups = None, []
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(_text(t) and t.strip() for t in turns):
        messages, followups = [{"role": "user", "content": turns[0]}], list(turns[1:])
    elif isinstance(row.get("messages"), list):
        msgs = row["messages"]
        if all(isinstance(m, dict) and _text(m.get("content")) and isinstance(m.get("role"), str) for m in msgs):
            messages = _until_last_user(msgs)
    elif _text(row.get("prompt")) and row["prompt"].strip():
        messages = [{"role": "user", "content": row["prompt"]}]
    if not messages:
        return None
    return Prompt(row_id, category, messages, followups)


def _read_file(path: Path) -> list[Any]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a leading BOM dropped
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise EyasError(f"prompt file '{path}' is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                        "save it as UTF-8") from None
    if not text.strip():
        raise EyasError(f"prompt file '{path}' is empty; give JSONL rows like {{\"turns\": [\"...\"], \"category\": \"...\"}}")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EyasError(f"prompt file '{path}' is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except (ValueError, RecursionError) as exc:  # an int past int()'s 4300 digits, nesting past the stack
            raise EyasError(f"prompt file '{path}' is not valid JSON ({_too_big(exc)})") from None
        return rows if isinstance(rows, list) else [rows]
    rows = []
    for line in text.split("\n"):  # not splitlines(): JSON strings may hold \u2028 and other separators it splits at
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (ValueError, RecursionError):
            rows.append(None)  # counted as unusable below
    return rows


def _too_big(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else " ".join(str(exc).split(";")[0].split())


def load_prompts(source: str, run_dir: str | Path | None = None, max_prompts: int = 0
                 ) -> tuple[list[Prompt], dict[str, int]]:
    """Prompts from `source` ('heldout' or a file) -> (prompts, skipped count by reason)."""
    skipped: dict[str, int] = {}
    if source == "heldout":
        if run_dir is None:
            raise EyasError("eval.prompts=heldout needs a recipe (its run directory holds the held-out split); "
                            "pass --prompts FILE instead")
        rows = list(_heldout_rows(run_dir))
        default_category, where = "heldout", f"the held-out split of '{run_dir}'"
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise EyasError(f"prompt file '{source}' does not exist; give a JSONL file or 'heldout'")
        rows = _read_file(path)
        default_category, where = "all", f"prompt file '{source}'"
    prompts = []
    for index, row in enumerate(rows):
        prompt = prompt_from_row(row, index, default_category)
        if prompt is None:
            skipped["no user prompt in row"] = skipped.get("no user prompt in row", 0) + 1
            continue
        prompts.append(prompt)
    if not prompts:
        raise EyasError(f"{where} has no usable prompts ({sum(skipped.values())} rows without a user turn); "
                        "rows need 'turns', 'messages' or 'prompt'")
    return balanced_first(prompts, max_prompts), skipped


def balanced_first(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over categories in file order (0: all), so a cap
    on a file sorted by category still covers every category."""
    if not limit or limit >= len(prompts):
        return prompts
    queues: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        queues.setdefault(prompt.category, []).append(prompt)
    chosen: list[Prompt] = []
    while len(chosen) < limit:
        for queue in queues.values():
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return chosen


def _heldout_rows(run_dir: str | Path):
    for row in load_prepared(run_dir, "heldout"):
        yield {"id": row.get("id"), "messages": row.get("messages")}


def render(prompt: Prompt, tokenizer) -> list[int]:
    """Token ids of the prompt through the chat template, ending with the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in prompt.messages) + "\n"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
