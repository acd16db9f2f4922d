"""Tree pieces: the verify forward's tree mask and positions, cache pruning, EAGLE-2 tree selection."""

from __future__ import annotations

import torch

from eyas.decode import SamplingParams, cache_kwarg, new_cache
from eyas.eval.kv import keep_positions, tree_mask
from eyas.eval.tree import build_tree, new_tree
from eyas.shapes import parse_shape

torch.set_num_threads(1)


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_tree_forward_equals_each_path_run_alone_and_pruning_keeps_the_path(tiny_qwen2_dir):
    model = load(tiny_qwen2_dir)
    kw = cache_kwarg(model)
    prefix = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    # root + tree: 0 -> {1, 2}, 1 -> {3}, 3 -> {4}, 2 -> {5}
    tokens = [17, 40, 41, 42, 43, 44]
    parents = [-1, 0, 0, 1, 3, 2]
    tree = new_tree(17)
    for token, parent in zip(tokens[1:], parents[1:]):
        tree.add(parent, token)
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=torch.tensor([prefix]), use_cache=True, **{kw: cache})
        P = len(prefix)
        out = model(input_ids=torch.tensor([tree.tokens]), position_ids=torch.tensor([[P + d for d in tree.depths]]),
                    attention_mask=tree_mask(model.config, P, tree.ancestor_mask(), tree.depths, model.dtype, "cpu"),
                    use_cache=True, **{kw: cache})
        for node in range(len(tokens)):
            path, i = [], node
            while i >= 0:
                path.append(tree.tokens[i])
                i = tree.parents[i]
            alone = model(input_ids=torch.tensor([prefix + path[::-1]])).logits[0, -1]
            assert torch.allclose(out.logits[0, node], alone, atol=1e-4), node
        # keep root + path 0 -> 1 -> 3 -> 4: the pruned cache equals the cache of prefix + that path
        keep_positions(cache, P, [0, 1, 3, 4])
        direct = new_cache()
        model(input_ids=torch.tensor([prefix + [17, 40, 42, 43]]), use_cache=True, **{kw: direct})
    for layer, ref in zip(cache.layers, direct.layers):
        assert layer.keys.shape == ref.keys.shape
        assert torch.allclose(layer.keys, ref.keys, atol=1e-5) and torch.allclose(layer.values, ref.values, atol=1e-5)


def test_dynamic_tree_keeps_the_best_nodes_by_cumulative_log_prob():
    vocab = 10
    generator = torch.Generator().manual_seed(3)
    table: dict[tuple, torch.Tensor] = {}

    def logits_for(path: tuple) -> torch.Tensor:
        if path not in table:
            table[path] = torch.randn(vocab, generator=generator) * 2
        return table[path]

    paths: list[tuple] = []
    calls = []

    def expand(parents, tokens):
        calls.append(len(tokens))
        rows = []
        for parent, token in zip(parents, tokens):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
            rows.append(logits_for(paths[-1]))
        return torch.stack(rows)

    shape = parse_shape("dynamic:depth=3,topk=3,nodes=7")
    tree = build_tree(shape, 0, logits_for(()), expand, SamplingParams(0.0), None)
    assert calls == [3, 3]  # the top-k frontier is expanded at each level after the first
    # brute force: every candidate the beam produced, scored by cumulative log-prob
    scores = {}
    for parent_path in [()] + paths:
        logp = logits_for(parent_path).log_softmax(-1)
        base = sum(logits_for(parent_path[:i]).log_softmax(-1)[parent_path[i]] for i in range(len(parent_path)))
        for token in logp.topk(3).indices.tolist():
            scores[parent_path + (token,)] = float(base + logp[token])
    best = sorted(scores, key=lambda p: -scores[p])[:7]
    got = []
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        got.append(tuple(path[::-1]))
    assert sorted(got) == sorted(best)
    assert all(p[:-1] in got or len(p) == 1 for p in got)  # ancestor-closed
    assert all(tree.depths[tree.parents[i]] == tree.depths[i] - 1 for i in range(1, len(tree)))
