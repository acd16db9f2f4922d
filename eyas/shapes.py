"""Draft shapes: what `eval.shapes` and `train.select_shape` name, and the acceptance a shape is expected to give.

  chain:K                              K draft tokens in a line.
  chain:K,confidence=C                 the chain cut after the deepest draft whose running product of
                                       the draft's confidences is still >= C (the eval decoder's
                                       `confident_chain`); at least one draft.
  tree:[[0],[1],[0,0],[0,1],[1,0]]     a static tree: each path lists child ranks from the root (rank r =
                                       the r-th best draft token at T=0, the r-th draw without replacement
                                       at T>0); every prefix of a path is listed and sibling ranks run 0, 1,
                                       2, ... without gaps.
  dynamic:depth=D,topk=K,nodes=N       EAGLE-2: expand the top-K children of the K best nodes (by cumulative
                                       draft log-prob) for D levels, then keep the best N.

Shared by eval (which builds and verifies the trees, `eyas.eval.tree`) and train (which chooses its `best`
checkpoint by a shape's simulated acceptance on held-out shards, `simulated_acceptance`).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass

from eyas.errors import EyasError

SHAPE_HELP = ("use chain:K, chain:K,confidence=C, tree:[[0],[1],[0,0],...] or dynamic:depth=D,topk=K,nodes=N")


@dataclass(frozen=True)
class Shape:
    kind: str                      # chain | tree | dynamic
    spec: str                      # the text the user gave (labels in tables and plots)
    depth: int
    paths: tuple = ()              # static tree: sorted tuple of rank tuples
    topk: int = 0                  # dynamic
    nodes: int = 0                 # dynamic
    # chain: verify only the drafts while the running product of the draft's confidences stays >= this (0: all K)
    confidence: float = 0.0

    @property
    def max_nodes(self) -> int:
        """Largest number of draft tokens a verify can carry (for context-length checks)."""
        if self.kind == "chain":
            return self.depth
        if self.kind == "tree":
            return len(self.paths)
        return self.nodes


def parse_shape(spec: str) -> Shape:
    """Parse a shape string; EyasError (one line) on anything malformed."""
    if not isinstance(spec, str) or ":" not in spec:
        raise EyasError(f"unknown draft shape {spec!r}; {SHAPE_HELP}")
    kind, _, body = spec.partition(":")
    kind = kind.strip()
    if kind == "chain":
        depth, comma, rest = body.partition(",")
        return Shape("chain", spec, depth=_positive_int(depth, spec, "K"), confidence=_confidence(comma + rest, spec))
    if kind == "tree":
        return _parse_static(spec, body)
    if kind == "dynamic":
        return _parse_dynamic(spec, body)
    raise EyasError(f"unknown draft shape {spec!r}; {SHAPE_HELP}")


def _positive_int(text: str, spec: str, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise EyasError(f"draft shape {spec!r}: {what} must be a positive integer; {SHAPE_HELP}") from None
    if value < 1:
        raise EyasError(f"draft shape {spec!r}: {what} must be >= 1; {SHAPE_HELP}")
    return value


def _confidence(text: str, spec: str) -> float:
    """The `,confidence=C` after a chain's K (0: none), C in (0, 1)."""
    if not text:
        return 0.0
    key, sep, value = text[1:].partition("=")
    try:
        threshold = float(value)
    except ValueError:
        threshold = -1.0
    if key.strip() != "confidence" or not sep or not 0 < threshold < 1:
        raise EyasError(f"draft shape {spec!r}: a chain takes confidence=C after K, C in (0, 1); {SHAPE_HELP}")
    return threshold


def _parse_static(spec: str, body: str) -> Shape:
    try:
        raw = json.loads(body)
    except json.JSONDecodeError:
        raise EyasError(f"draft shape {spec!r}: the tree is not a JSON list of paths; {SHAPE_HELP}") from None
    if not isinstance(raw, list) or not raw or not all(
        isinstance(p, list) and p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
        for p in raw
    ):
        raise EyasError(f"draft shape {spec!r}: give a non-empty list of non-empty lists of ranks >= 0; {SHAPE_HELP}")
    paths = sorted({tuple(p) for p in raw}, key=lambda p: (len(p), p))
    present = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in present:
            raise EyasError(f"draft shape {spec!r}: path {list(path)} has no parent {list(path[:-1])} in the tree")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in present:
            raise EyasError(f"draft shape {spec!r}: path {list(path)} needs its elder sibling "
                            f"{list(path[:-1] + (path[-1] - 1,))} (sibling ranks must run 0, 1, 2, ...)")
    return Shape("tree", spec, depth=max(len(p) for p in paths), paths=tuple(paths))


def _parse_dynamic(spec: str, body: str) -> Shape:
    values: dict[str, int] = {}
    for part in body.split(","):
        key, sep, text = part.partition("=")
        key = key.strip()
        if not sep or key not in ("depth", "topk", "nodes"):
            raise EyasError(f"draft shape {spec!r}: expected depth=D,topk=K,nodes=N; {SHAPE_HELP}")
        values[key] = _positive_int(text, spec, key)
    missing = {"depth", "topk", "nodes"} - set(values)
    if missing:
        raise EyasError(f"draft shape {spec!r}: missing {', '.join(sorted(missing))}; {SHAPE_HELP}")
    return Shape("dynamic", spec, depth=values["depth"], topk=values["topk"], nodes=values["nodes"])


def ranks_needed(shape: Shape) -> int:
    """How many of the draft's ranks a shape drafts from at any depth (1 for a chain)."""
    if shape.kind == "tree":
        return 1 + max(rank for path in shape.paths for rank in path)
    return shape.topk if shape.kind == "dynamic" else 1


def simulated_acceptance_length(step_accuracy: list[float]) -> float:
    """sum over k of the product of per-step accuracies up to k (expected accepted drafts, chain, greedy)."""
    total, running = 0.0, 1.0
    for acc in step_accuracy:
        running *= acc
        total += running
    return total


def simulated_acceptance(shape: Shape, rank_rates: list[list[float]]) -> float:
    """Expected drafts accepted per verify at T=0, when at depth k the target's token is the draft's rank-r
    token with probability `rank_rates[k][r]` (r < `ranks_needed(shape)`; the trainer's are over the positions a
    tree's branch reached, so they are conditional on the depths above), each depth independent of the ones before
    otherwise; depths past the rates' are not counted (a draft trained `train.ttt_steps` deep is not scored deeper).

    chain:K (a confidence cut included, which only shortens it): `simulated_acceptance_length` of the rank-0
    rates (the per-step accuracies). A static tree: the sum over its
    paths of the product of each depth's rate at the path's rank (the target's path matches at most one node a
    depth). dynamic: the best tree of N nodes, K children a node, D deep under the same rates, which a dynamic
    tree gets on average where its own ordering of the nodes matches these rates.
    """
    depth = min(shape.depth, len(rank_rates))
    if shape.kind == "chain":
        return simulated_acceptance_length([rates[0] for rates in rank_rates[:depth]])
    if shape.kind == "tree":
        return _tree_value([p for p in shape.paths if len(p) <= depth], rank_rates)
    return sum(_best_nodes(rank_rates[:depth], shape.topk, shape.nodes))


def _tree_value(paths: list[tuple[int, ...]], rank_rates: list[list[float]]) -> float:
    return sum(math.prod(rank_rates[k][rank] for k, rank in enumerate(path)) for path in paths)


def _best_nodes(rank_rates: list[list[float]], topk: int, nodes: int) -> list[float]:
    """The values of the `nodes` most valuable nodes, best first: a node's value is the product of its path's
    rates, never above its parent's, so the best N always form a tree (every parent taken before its child)."""
    frontier = [(-rank_rates[0][r], (r,)) for r in range(topk)] if rank_rates else []
    heapq.heapify(frontier)
    taken: list[float] = []
    while frontier and len(taken) < nodes:
        value, path = heapq.heappop(frontier)
        taken.append(-value)
        if len(path) < len(rank_rates):
            for r in range(topk):
                heapq.heappush(frontier, (value * rank_rates[len(path)][r], (*path, r)))
    return taken
