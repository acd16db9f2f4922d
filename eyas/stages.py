"""Is a stage's output current? One answer for every stage, on the command line and in the quickstart.

Each stage's output depends on some recipe sections (or single keys) and on what it reads from
the stage before it. When a stage finishes it writes a record, `stage.json`, beside its output:

    {"stage": "dump", "digest": "…", "sections": {...the values it depends on...},
     "inputs": "<digest of its inputs>", "files": [files its output consists of], ...}

A later run of the same stage compares the record with the recipe it is given: the same
settings, the same inputs (the upstream stage's record, data files by size and mtime) and every
listed file still there mean the output is current and the stage is skipped; otherwise it runs
again and says why in one line (`data.max_length changed (96 -> 80)`). `--force` runs it anyway.

Inputs chain through the records: dump's record holds prepare's digest, train's holds dump's
(or prepare's when training online), so a redone prepare makes the dump behind it stale.
Eval and export fingerprint the checkpoints they read (size and mtime of the weights), which
covers a draft retrained in place.

Which sections, upstream stages, output folder and finished-files each stage has is a column of
the stage table, `eyas.pipeline`; this module only keeps and compares the records.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.io import atomic_write_json
from eyas.pipeline import STAGES, Stage
from eyas.recipe_schema import Recipe

RECORD = "stage.json"
RECORD_VERSION = 1


def _source_paths(recipe: Recipe) -> list[str]:
    """Local files the prepared data is made from: the data source and a replacement chat template."""
    paths = []
    if recipe.data.source not in ("chitchat", "none"):
        paths.append(recipe.data.source)
    if recipe.target.chat_template:
        paths.append(recipe.target.chat_template)
    return paths


@dataclass(frozen=True)
class Verdict:
    current: bool
    reason: str  # why it must run ("" for a first run), or what was found current


def _stage(name: str) -> Stage:
    if name not in STAGES:
        raise EyasError(f"unknown stage '{name}'; stages: {', '.join(STAGES)}")
    return STAGES[name]


def output_dir(name: str, recipe: Recipe) -> Path:
    """The folder the stage writes its output (and its record) to."""
    output = _stage(name).output
    assert output is not None  # STAGES holds the pipeline stages only, each with an output
    return output(recipe)


def _value(recipe_dict: dict, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    value = recipe_dict[section]
    return value[key] if key else value


def settings(name: str, recipe: Recipe) -> dict:
    """The recipe values the stage's output depends on, keyed by section or dotted key."""
    as_dict = recipe.to_dict()
    return {dotted: _value(as_dict, dotted) for dotted in _stage(name).sections}


def fingerprint(paths: Iterable[str | Path]) -> list:
    """Size and mtime of each file (of every file under a folder); names that are not paths stay as they are."""
    out: list = []
    for item in paths:
        path = Path(item)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))[:2000]
        else:
            out.append(str(item))
            continue
        for f in files:
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


def record_path(name: str, recipe: Recipe) -> Path:
    return output_dir(name, recipe) / RECORD


def read_record(name: str, recipe: Recipe) -> dict | None:
    path = record_path(name, recipe)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: treated as absent, the stage runs and rewrites it
    return record if isinstance(record, dict) and record.get("version") == RECORD_VERSION else None


def input_digest(name: str, recipe: Recipe, inputs: Iterable[str | Path] = ()) -> str:
    """One digest over the upstream stages' records and the input files this stage reads."""
    stage = _stage(name)
    upstream = {}
    for up in stage.upstream(recipe):
        record = read_record(up, recipe)
        upstream[up] = record["digest"] if record else None
    files = fingerprint([*(_source_paths(recipe) if name == "prepare" else []), *inputs])
    return _digest({"upstream": upstream, "files": files})


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _flatten(value: Any, prefix: str) -> dict:
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def _changes(saved: dict, current: dict) -> list[str]:
    old, new = {}, {}
    for dotted in current:
        old.update(_flatten(saved.get(dotted), dotted))
        new.update(_flatten(current[dotted], dotted))
    return [f"{key} changed ({old.get(key)!r} -> {new.get(key)!r})" for key in new if old.get(key) != new.get(key)]


def check(name: str, recipe: Recipe, inputs: Iterable[str | Path] = ()) -> Verdict:
    """Whether the stage's output is current for this recipe; if not, why it must run."""
    stage = _stage(name)
    out = output_dir(name, recipe)
    record = read_record(name, recipe)
    if record is None:
        if any((out / f).exists() for f in stage.done_files) or (out / RECORD).exists():
            return Verdict(False, f"'{out}' has no readable stage record (an older eyas or an interrupted run)")
        return Verdict(False, "")
    changes = _changes(record.get("sections") or {}, settings(name, recipe))
    if changes:
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        return Verdict(False, "; ".join(changes[:3]) + more)
    if record.get("inputs") != input_digest(name, recipe, inputs):
        ups = "/".join(stage.upstream(recipe))
        return Verdict(False, f"the {ups} output it reads has changed" if ups else "the files it reads have changed")
    missing = [f for f in record.get("files", []) if not (out / f).exists()]
    if missing:
        return Verdict(False, f"'{out / missing[0]}' is missing")
    return Verdict(True, f"'{out}' is current for these settings")


def _rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def write_record(name: str, recipe: Recipe, inputs: Iterable[str | Path] = (),
                 files: Iterable[str | Path] = ()) -> Path:
    """Record that the stage finished for this recipe (`files`: more output files that must stay)."""
    stage = _stage(name)
    out = output_dir(name, recipe)
    listed = list(stage.done_files)
    for f in files:
        path = Path(f)
        listed.append(str(path.relative_to(out)) if path.is_relative_to(out) else str(path.resolve()))
    sections = settings(name, recipe)
    inputs_digest = input_digest(name, recipe, inputs)
    # The finish time is in the digest: a redone stage makes the stages behind it stale even with the same settings.
    finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {"version": RECORD_VERSION, "stage": name, "digest": _digest([sections, inputs_digest, time.time_ns()]),
              "sections": sections, "inputs": inputs_digest, "files": listed, "finished": finished}
    atomic_write_json(out / RECORD, record)
    return out / RECORD


def run(name: str, recipe: Recipe, body: Callable[[], Any], *, force: bool = False,
        inputs: Iterable[str | Path] = (), files: Callable[[Any], Iterable[str | Path]] | None = None,
        finished: Callable[[Any], bool] = lambda result: True,
        say: Callable[[str], None] | None = None) -> tuple[bool, Any]:
    """Run `body` unless the stage's output is current; returns (ran, body's result or None).

    `inputs`: files (checkpoints, prompt files) the stage reads besides the upstream records.
    `files(result)`: output files the record lists, `finished(result)`: whether the body completed
    (a preempted training run does not write a record). `say` prints the one-line verdict.
    """
    say = say or (lambda line: print(f"eyas {name}: {line}", flush=True))
    inputs = list(inputs)
    verdict = check(name, recipe, inputs)
    if verdict.current and not force:
        say(f"skipped: {verdict.reason} (--force redoes it)")
        return False, None
    if force and verdict.current:
        say("--force: running although its output is current")
    elif verdict.reason:
        say(f"running again: {verdict.reason}")
    stale = record_path(name, recipe)
    if _rank_zero() and stale.is_file():
        stale.unlink()  # an interrupted rerun must not leave the old record vouching for a half-written output
    result = body()
    out = output_dir(name, recipe)
    done = all((out / f).exists() for f in _stage(name).done_files)
    if _rank_zero() and done and finished(result):
        write_record(name, recipe, inputs, files(result) if files else ())
    return True, result
