"""Distribution exactness for static trees (siblings drawn without replacement from q, recursive
rejection over siblings); method and tables in test_eval_exact.py. With top-k/top-p: test_eval_exact_filters.py."""

from __future__ import annotations

from test_eval_exact import check_exact, tables  # noqa: F401  (the module-scoped tables fixture)

from eyas.decode import SamplingParams


def test_static_tree_sampling_matches_target_distribution(tables):  # noqa: F811
    check_exact(tables, "tree:[[0],[1],[2],[0,0],[0,1],[1,0]]", SamplingParams(1.0))
