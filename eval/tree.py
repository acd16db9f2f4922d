"""Draft shapes and the token tree the target verifies in one forward.

Shapes are parsed in `eyas.shapes` (`parse_shape`), shared with the trainer's checkpoint choice.

A built tree is held as flat lists in verify order: index 0 is the root (the last token
already chosen, whose target KV is not cached yet), nodes 1..n follow with every parent
before its children, so `tokens` is exactly the target's input for the verify forward.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from eyas.decode import SamplingParams, process_logits
from eyas.eval.verify import draw_candidates
from eyas.shapes import Shape

# --------------------------------------------------------------------------------------------
# The built tree


@dataclass
class Tree:
    """A token tree in verify order (index 0 = root)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    draft_ids: list[int]                     # the draft's id for nodes it ran forward (-1: not run)
    children: list[list[int]]                # per index, children in the order they are tried
    child_q: dict[int, torch.Tensor | None] = field(default_factory=dict)  # per parent: q of its children

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.draft_ids.append(-1)
        self.children.append([])
        self.children[parent].append(index)
        return index

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n+1, n+1]: row i is True at i and at each of its ancestors."""
        n = len(self.tokens)
        rows = [0] * n
        for i in range(n):
            parent = self.parents[i]
            rows[i] = (rows[parent] if parent >= 0 else 0) | (1 << i)
        bits = torch.tensor([[(r >> j) & 1 for j in range(n)] for r in rows], dtype=torch.bool)
        return bits

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i] for i in path]


def confident_chain(tree: Tree, confidences: list[float], threshold: float) -> Tree:
    """The chain `tree` cut after the deepest draft whose running product of confidences (the draft's
    probability that each draft up to it is accepted) is still >= `threshold`; the first draft is always kept.

    Exact for sampling too: whether draft d is kept depends only on the drafts before it and on d's own
    confidence, which the draft computed before d was drawn (from d's parent), so the cut is a stopping
    rule of the drafting, as if the later drafts had never been drawn."""
    keep, running = 1, confidences[0]
    for confidence in confidences[1:]:
        running *= confidence
        if running < threshold:
            break
        keep += 1
    cut = new_tree(tree.tokens[0])
    for node in range(1, keep + 1):
        cut.add(node - 1, tree.tokens[node])
        cut.draft_ids[node] = tree.draft_ids[node]
    cut.child_q = {parent: q for parent, q in tree.child_q.items() if parent < keep}
    return cut


def new_tree(root: int) -> Tree:
    return Tree(tokens=[root], parents=[-1], depths=[0], draft_ids=[-2], children=[[]])


Expand = Callable[[list[int], list[int]], torch.Tensor]
"""expand(parents, tokens) -> draft logits [n, V] for the new nodes' children: parents are the draft's ids of
the new nodes' parents (-1 = the root), tokens the new nodes' tokens."""

Expansion = tuple[list[int], list[int]]
"""What a tree builder asks of the draft: (parents, tokens), the arguments of an `Expand`."""

Steps = Generator[Expansion, torch.Tensor, Tree]
"""A tree being built (`tree_steps`): yields each expansion it needs, is sent the draft's logits for it [n, V],
returns the tree."""


def build_tree(shape: Shape, root: int, root_logits: torch.Tensor, expand: Expand,
               params: SamplingParams, generator: torch.Generator | None) -> Tree:
    """Draft a tree of the given shape under `root` (root_logits: the draft's logits for its children)."""
    steps = tree_steps(shape, root, root_logits, params, generator)
    logits = None
    while True:
        try:
            parents, tokens = steps.send(logits)
        except StopIteration as built:
            return built.value
        logits = expand(parents, tokens)


def tree_steps(shape: Shape, root: int, root_logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> Steps:
    """`build_tree` with the draft kept outside: the builder yields each expansion and waits for its logits, so
    a batch of rows can build their trees in lockstep, every row's expansion of one depth in one draft forward
    (`eyas.eval.batched`). Each row draws its random numbers in the same order either way."""
    tree = new_tree(root)
    if shape.kind == "chain":
        yield from _build_chain(tree, shape, root_logits, params, generator)
    elif shape.kind == "tree":
        yield from _build_static(tree, shape, root_logits, params, generator)
    else:
        yield from _build_dynamic(tree, shape, root_logits, params)
    return tree


def _expand(tree: Tree, nodes: list[int]) -> Generator[Expansion, torch.Tensor, torch.Tensor]:
    """Run the draft on these tree nodes (yields the expansion), numbering them in the draft's order."""
    parents = [tree.draft_ids[tree.parents[i]] if tree.parents[i] > 0 else -1 for i in nodes]
    logits = yield parents, [tree.tokens[i] for i in nodes]
    first = max(tree.draft_ids) + 1  # the root holds -2, unexpanded nodes -1
    for offset, i in enumerate(nodes):
        tree.draft_ids[i] = first + offset
    return logits


def _build_chain(tree: Tree, shape: Shape, logits: torch.Tensor, params: SamplingParams, generator):
    parent = 0
    for depth in range(1, shape.depth + 1):
        tokens, q = draw_candidates(logits, 1, params, generator)
        node = tree.add(parent, tokens[0])
        tree.child_q[parent] = q
        if depth < shape.depth:
            logits = (yield from _expand(tree, [node]))[0]
        parent = node


def _build_static(tree: Tree, shape: Shape, root_logits: torch.Tensor, params: SamplingParams, generator):
    # children count per path prefix, and which prefixes have children (need a draft forward)
    fanout: dict[tuple, int] = {}
    for path in shape.paths:
        fanout[path[:-1]] = max(fanout.get(path[:-1], 0), path[-1] + 1)
    index_of: dict[tuple, int] = {(): 0}
    logits_of: dict[tuple, torch.Tensor] = {(): root_logits}
    for depth in range(1, shape.depth + 1):
        level = [prefix for prefix in fanout if len(prefix) == depth - 1 and prefix in index_of]
        created: list[tuple] = []
        for prefix in sorted(level):
            parent = index_of[prefix]
            tokens, q = draw_candidates(logits_of.pop(prefix), fanout[prefix], params, generator)
            tree.child_q[parent] = q
            for rank, token in enumerate(tokens):
                path = prefix + (rank,)
                index_of[path] = tree.add(parent, token)
                created.append(path)
        to_expand = [path for path in created if path in fanout]
        if to_expand:
            logits = yield from _expand(tree, [index_of[p] for p in to_expand])
            for path, row in zip(to_expand, logits):
                logits_of[path] = row


def _top_children(logits: torch.Tensor, k: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best children per row by draft log-probability (T=0 ranks with T=1 probabilities)."""
    if params.greedy:
        return logits.float().log_softmax(-1).topk(k, dim=-1)
    top = process_logits(logits, params).topk(k, dim=-1)  # log of k values, not of the vocabulary
    return top.values.log(), top.indices


def _build_dynamic(tree: Tree, shape: Shape, root_logits: torch.Tensor, params: SamplingParams):
    """EAGLE-2: beam of the top-k nodes by cumulative log-prob, rerank all candidates, keep N."""
    k = shape.topk
    # candidate pool: (score, depth, order, parent_candidate, token); the root is candidate -1
    pool: list[tuple[float, int, int, int, int]] = []

    def add_children(parents: list[tuple[int, float]], depth: int, logits: torch.Tensor) -> list[int]:
        """Top-k children of each (candidate, score) parent; logits [n, V], scored in one batch."""
        values_all, tokens_all = _top_children(logits, min(k, logits.shape[-1]), params)
        made = []
        for (parent_cand, parent_score), values, tokens in zip(parents, values_all.tolist(), tokens_all.tolist()):
            for value, token in zip(values, tokens):
                if value == float("-inf"):
                    break  # filtered out by top-k/top-p: never a useful candidate
                pool.append((parent_score + value, depth, len(pool), parent_cand, token))
                made.append(len(pool) - 1)
        return made

    frontier = add_children([(-1, 0.0)], 1, root_logits[None])
    draft_nodes: dict[int, int] = {}  # candidate -> the draft's id for it
    next_id = 0
    for depth in range(2, shape.depth + 1):
        frontier = sorted(frontier, key=lambda c: (-pool[c][0], pool[c][2]))[:k]
        if not frontier:
            break
        parents = [draft_nodes[pool[c][3]] if pool[c][3] >= 0 else -1 for c in frontier]
        logits = yield parents, [pool[c][4] for c in frontier]
        for c in frontier:
            draft_nodes[c] = next_id
            next_id += 1
        frontier = add_children([(c, pool[c][0]) for c in frontier], depth, logits)
    # rerank: best N by score; ties go to the shallower (so a parent always precedes its child)
    chosen = sorted(range(len(pool)), key=lambda c: (-pool[c][0], pool[c][1], pool[c][2]))[: shape.nodes]
    index_of: dict[int, int] = {-1: 0}
    for c in sorted(chosen, key=lambda c: (pool[c][1], pool[c][2])):
        index_of[c] = tree.add(index_of[pool[c][3]], pool[c][4])
        if c in draft_nodes:
            tree.draft_ids[index_of[c]] = draft_nodes[c]
    # candidates are deterministic given the draft: verify with point-mass proposals (delta mode);
    # children were added per parent in descending score, the order they are tried in
    tree.child_q = {i: None for i in range(len(tree))}
