"""The eval table on a 120-column terminal: every header and label whole, nothing cut with an ellipsis."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from eyas.eval.report import print_report

SHAPES = (("chain:5", 5), ("dynamic:depth=6,topk=8,nodes=32", 6))
DRAFTS = ("runs/quickstart/checkpoints/best", "truncated:4")


def _summary(depth: int) -> dict:
    return {"alpha": [0.83, 0.71, 0.6, 0.5, 0.41, 0.33][:depth], "cumulative": [0.8, 0.6, 0.4, 0.3, 0.2, 0.1][:depth],
            "tau": 2.91, "tau_from_alpha": 2.95, "mean_tree_nodes": 32.0, "tokens_per_s": 123.4, "speedup": 1.87,
            "time": {"draft_frac": 0.4, "target_frac": 0.55, "bookkeeping_frac": 0.05},
            "greedy_match": {"matched": 120, "compared": 128}}


def _report(categories: tuple[str, ...]) -> dict:
    configs = [{"draft": d, "shape": shape, "label": f"{d} {shape}", "overall": _summary(depth),
                "per_category": {c: _summary(depth) for c in categories}} for d in DRAFTS for shape, depth in SHAPES]
    return {"target": {"name": "smollm2-135m-instruct"}, "configs": configs,
            "baseline": {"overall": {"tokens_per_s": 66.0}},
            "settings": {"temperature": 0, "prompts_used": 20, "max_new_tokens": 128, "skipped": {}}}


@pytest.mark.parametrize("width", [120, 160])
def test_table_fits_without_cutting_headers_or_labels(width):
    console = Console(width=width, record=True, quiet=False, file=io.StringIO())
    print_report(_report(("coding", "math", "writing")), console)
    text = console.export_text()
    assert "…" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width
    header = next(line for line in text.splitlines() if line.startswith("draft "))
    for name in ("shape", "tau", "tau(a)", "a1", "a6", "cum@K", "nodes", "tok/s", "speedup", "d/t/o %", "=greedy"):
        assert f" {name} " in f" {header} ", name
    for part in ("dynamic:d", "topk=8,", "nodes=32", "chain:5", "truncated:", "1.87x", "40/55/5%", "120/128"):
        assert part in text, part
    assert text.count("speculative decoding on ") == 1 and "per category" in text
