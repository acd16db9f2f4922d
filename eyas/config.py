"""Reading and writing recipes: one YAML file per run, loaded into validated dataclasses.

Rules a user relies on:
- an unknown or misspelt key is an error naming the key and the closest valid ones;
- a value of the wrong type or out of range is an error naming the key;
- command-line overrides `section.key=value` are parsed as YAML scalars/lists;
- the resolved recipe is written next to every output (`save_resolved`), its paths made absolute.

The sections and their keys: `eyas.recipe_schema`; the checks a recipe passes: `eyas.recipe_checks`, the rules
its kind adds: `eyas.recipe_kinds`; the key reference of docs/recipes.md: `eyas.recipe_docs`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import yaml

from eyas.errors import EyasError
from eyas.io import atomic_write_text
from eyas.recipe_checks import validate
from eyas.recipe_kinds import apply_kind_defaults, build_draft
from eyas.recipe_schema import Recipe, build_section, section_class, suggest


class _RecipeLoader(yaml.SafeLoader):
    """YAML with 1.2 booleans: only true/false are booleans, so `no`, `on`, `off` stay strings
    (`train.mixed_precision: no` means the word, not False)."""


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass


# What `_yaml` raises for text it cannot read: PyYAML's own errors, the plain Python errors its constructors
# let out for a tagged value they cannot build (`!!float x`, `!!timestamp 2024-13-45`, `!!bool maybe`, an int
# past int()'s 4300 digits), and RecursionError for nesting deeper than Python's stack.
_YAML_FAILURES = (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError)


def _yaml_problem(exc: BaseException) -> str:
    """One line saying what is wrong with a YAML text (`exc` one of _YAML_FAILURES)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, yaml.YAMLError):
        text = getattr(exc, "problem", None) or str(exc)
    else:
        text = f"a value it cannot build ({type(exc).__name__}: {exc})"
    return " ".join(text.split())


def from_dict(raw: Any) -> Recipe:
    """A validated Recipe from its sections as YAML holds them: each typed, the kind's defaults given, checked."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise EyasError(f"a recipe must be a YAML mapping of sections, got {type(raw).__name__}")
    sections = {f.name: section_class(f.name) for f in dataclasses.fields(Recipe)}
    built = {}
    for name, values in raw.items():
        if name not in sections:
            raise EyasError(f"unknown recipe section {name!r}: {suggest(str(name), list(sections))}")
        built[name] = build_draft(values) if name == "draft" else build_section(name, sections[name], values)
    recipe = Recipe(**built)
    apply_kind_defaults(recipe, raw)
    return validate(recipe)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings to a raw recipe dict; values are parsed as YAML."""
    raw = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in (raw or {}).items()}
    for item in overrides:
        dotted, sep, text = item.partition("=")
        if not sep or dotted.count(".") != 1:
            raise EyasError(f"override {item!r} must look like section.key=value (for example train.lr=3e-4)")
        section, key = dotted.split(".")
        try:
            value = _yaml(text) if text != "" else ""
        except _YAML_FAILURES as exc:
            raise EyasError(f"override {item!r}: value is not valid YAML ({_yaml_problem(exc)})") from None
        if isinstance(value, str) and _looks_numeric(value):
            value = float(value)  # YAML 1.1 reads "3e-4" as a string; users mean a number
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            raise EyasError(f"override '{item}': recipe section '{section}' is not a mapping")
        target[key] = value
    return raw


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity")


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (None: all defaults), apply overrides, validate."""
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise EyasError(f"recipe file '{path}' does not exist; pass the path of a YAML recipe (see recipes/)")
        try:
            raw = _yaml(_recipe_text(p))
        except _YAML_FAILURES as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where else ""
            raise EyasError(f"recipe file '{path}' is not valid YAML{at}: {_yaml_problem(exc)}") from None
        if raw is not None and not isinstance(raw, dict):
            raise EyasError(f"recipe file '{path}' must be a YAML mapping of sections (run:, target:, ...)")
    return from_dict(apply_overrides(raw or {}, overrides or []))


def _recipe_text(path: Path) -> str:
    """A recipe file's text (UTF-8, a BOM allowed); a binary or non-UTF-8 file is one clear error."""
    data = path.read_bytes()
    nul = data.find(b"\x00", 0, 8192)
    if nul >= 0:
        raise EyasError(f"recipe file '{path}' is a binary file (NUL byte at offset {nul}), not a "
                        "YAML recipe; pass the path of a YAML recipe (see recipes/)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise EyasError(f"recipe file '{path}' is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                        "save it as UTF-8") from None


def save_resolved(recipe: Recipe, directory: str | Path, name: str = "recipe.yaml") -> Path:
    """Write the fully resolved recipe (every key, defaults included) next to a stage's output.

    Its paths are made absolute (`absolute_paths`): a saved copy, passed to a stage from another
    folder, names the same run directory, target and data as the recipe it was resolved from."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / name
    atomic_write_text(out, yaml.safe_dump(absolute_paths(recipe).to_dict(), sort_keys=False))
    return out


# Recipe keys that hold paths, each with the words it takes that are not paths (a trailing ':' marks a prefix,
# as in eval.drafts' `truncated:N`). Paths are read against the working directory, like any command-line path.
PATH_KEYS: dict[str, tuple[str, ...]] = {
    "run.output_dir": (), "target.path": ("smollm2-135m-instruct",), "target.chat_template": (),
    "data.source": ("chitchat", "none"), "data.regenerate_cache": (), "eval.prompts": ("heldout",),
    "eval.checkpoint": (), "eval.drafts": ("truncated:", "mixture:"), "eval.output": (), "export.checkpoint": (),
    "train.trust_checkpoint": (),
}


def absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe with every relative path made absolute against the working directory (words such as
    `chitchat` or `heldout`, empty values and home-relative `~/...` paths kept as they are)."""
    sections: dict[str, Any] = {}
    for dotted, words in PATH_KEYS.items():
        section, key = dotted.split(".")
        values = sections.get(section, getattr(recipe, section))
        value = getattr(values, key)
        made = [_absolute(v, words) for v in value] if isinstance(value, list) else _absolute(value, words)
        sections[section] = dataclasses.replace(values, **{key: made})
    return dataclasses.replace(recipe, **sections)


def _absolute(value: Any, words: tuple[str, ...]) -> Any:
    if not isinstance(value, str) or not value or value.lower() in words:
        return value
    if any(value.startswith(word) for word in words if word.endswith(":")):
        return value
    return value if os.path.isabs(os.path.expanduser(value)) else os.path.abspath(value)
