"""Distribution exactness with top-k and top-p applied to target and draft alike (static tree, T=0.7);
method and tables in test_eval_exact.py."""

from __future__ import annotations

from test_eval_exact import check_exact, tables  # noqa: F401  (the module-scoped tables fixture)

from eyas.decode import SamplingParams


def test_filtered_sampling_matches_filtered_target_distribution(tables):  # noqa: F811
    check_exact(tables, "tree:[[0],[1],[0,0],[1,0]]", SamplingParams(0.7, top_p=0.9, top_k=6))
