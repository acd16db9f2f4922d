"""Distribution exactness for static trees (siblings drawn without replacement from q, recursive
rejection over siblings), with and without top-k/top-p; method and tables in test_eval_exact.py."""

from __future__ import annotations

import pytest

from eyas.eval.verify import SamplingParams

from test_eval_exact import check_exact, tables  # noqa: F401  (the module-scoped tables fixture)

CASES = [
    ("tree:[[0],[1],[2],[0,0],[0,1],[1,0]]", SamplingParams(1.0)),
    ("tree:[[0],[1],[0,0],[1,0]]", SamplingParams(0.7, top_p=0.9, top_k=6)),
]


@pytest.mark.parametrize("spec,params", CASES, ids=["wide", "top_p_top_k"])
def test_static_tree_sampling_matches_target_distribution(tables, spec, params):  # noqa: F811
    check_exact(tables, spec, params)
