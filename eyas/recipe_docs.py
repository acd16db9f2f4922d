"""The recipe key reference: every key with its type, default and doc, the generator of docs/recipes.md's table.

Regenerate the table (between the KEYS markers of docs/recipes.md) after adding or changing a key:
`python -c "from eyas.recipe_docs import reference_markdown as r; print(r())"`; tests/test_config.py fails while
it differs from the code.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from eyas.draft.registry import KINDS, kind_rules
from eyas.recipe_schema import Recipe, section_class


def reference_markdown() -> str:
    """Every recipe key with type, default and doc, as a Markdown table (for the README)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    defaults = Recipe()
    for section in dataclasses.fields(Recipe):
        cls = section_class(section.name)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "options":  # the kinds' own keys, listed below the section's
                lines += _kind_option_rows()
                continue
            default = getattr(getattr(defaults, section.name), f.name)
            lines.append(_reference_row(f"{section.name}.{f.name}", hints[f.name], default, f.metadata.get("doc", "")))
    return "\n".join(lines)


def recipe_keys() -> dict[str, Any]:
    """Every recipe key ("section.key") and its type: the sections' own, then each kind's (imports every kind)."""
    keys = {f"{section.name}.{f.name}": typing.get_type_hints(section_class(section.name))[f.name]
            for section in dataclasses.fields(Recipe) for f in dataclasses.fields(section_class(section.name))
            if (section.name, f.name) != ("draft", "options")}
    for kind in KINDS:
        options = kind_rules(kind).options
        keys.update({f"draft.{name}": hint for name, hint in (typing.get_type_hints(options) if options else {}).items()})
    return keys


def _reference_row(key: str, annotation: Any, default: Any, doc: str) -> str:
    shown = f"`{default!r}`" if default != "" else "`''`"
    return f"| `{key}` | {annotation.__name__} | {shown} | {doc} |"


def _kind_option_rows() -> list[str]:
    """A row per kind option (`draft.<key>`, its kind named in its doc), in registry order (imports every kind)."""
    rows = []
    for kind in KINDS:
        options = kind_rules(kind).options
        if options is None:
            continue
        hints = typing.get_type_hints(options)
        rows += [_reference_row(f"draft.{f.name}", hints[f.name], f.default, f.metadata["doc"])
                 for f in dataclasses.fields(options)]
    return rows
