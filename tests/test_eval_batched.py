"""Many prompts at once (`eyas.eval.batched`): every row is exact on its own.

* T=0: each row of a batch (prompts of 3 to 41 tokens, rows stopping at EOS or at the token
  limit at different rounds) equals its prompt's own greedy decode (HF `generate`) and the
  one-at-a-time decoder's output, with the same acceptance counts per round and per depth
  (fp32, tiny Llama and Qwen2; drafts that accept everything, some, or almost nothing).
* The batched drafts (eagle, eagle3, peagle, dflash, dspark, mtp) give the same logits per row as the
  one-at-a-time drafts through start, three depths of ragged tree expansions and a ragged commit.
* T>0: row b with seed s reproduces `SpeculativeDecoder(seed=s)` on that prompt alone, and
  over 16,000 rows of one context the second and third tokens follow the target's own
  distribution (TV within 1.6x of what as many direct draws give on average, as
  `test_eval_sampled_targets.py` checks; rows accepting 0, 1 or 2 draft tokens in the same verify; slow).
* `evaluate(batch_size=k)` gives the same acceptance figures as one at a time, a `prompts_per_s`,
  and runs an unbatched draft x shape one at a time with the reason.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fixtures import build_tiny_target
from test_eval_exact import CONTEXT, VOCAB, tiny_vocab_target, tv, tv_noise
from test_eval_heads import make_checkpoint

from eyas.config import load_recipe
from eyas.decode import SamplingParams, process_logits, stop_token_ids
from eyas.errors import EyasError
from eyas.eval.batched import BatchedDecoder, batched_draft
from eyas.eval.decoder import SpeculativeDecoder, target_decode_batch, target_generate
from eyas.eval.drafts import LMDraft, truncated_target
from eyas.eval.head_draft import load_head_draft
from eyas.eval.prompts import Prompt
from eyas.eval.runner import EncodedPrompt, evaluate
from eyas.shapes import parse_shape

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
LENGTHS = [3, 9, 20, 41, 5, 12]


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def assert_rows_match_one_at_a_time(target, draft, spec, params, eos, cases, new_tokens, greedy_refs=None):
    shape = parse_shape(spec)
    seeds = [11 + i for i in range(len(cases))]
    batch = BatchedDecoder(target, draft, shape, params, eos).generate(cases, new_tokens, seeds)
    for i, (prompt, row) in enumerate(zip(cases, batch)):
        single = SpeculativeDecoder(target, draft, shape, params, eos, seed=seeds[i]).generate(prompt, new_tokens)
        where = f"{draft.name} {spec} T={params.temperature} row {i} ({len(prompt)} prompt tokens)"
        assert row.tokens == single.tokens, where
        assert (row.accepted, row.attempts, row.accepts, row.tree_sizes) == \
               (single.accepted, single.attempts, single.accepts, single.tree_sizes), where
        if greedy_refs is not None:
            assert row.tokens == greedy_refs[i], where
    return batch


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_greedy_rows_equal_their_own_greedy_decode(family, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    target, _ = load(tiny_llama_dir if family == "llama" else tiny_qwen2_dir)
    other, _ = load(build_tiny_target(tmp_path / "other", family, seed=99))
    cases = prompts(target.config.vocab_size)
    # an EOS the target emits early for one prompt, so that row leaves the batch while the others go on
    stop = target_generate(target, cases[2], 30, GREEDY, [])[5]
    eos = [stop]
    references = [target_generate(target, p, 30, GREEDY, eos) for p in cases]
    assert min(len(r) for r in references) < 30 == max(len(r) for r in references)
    drafts = [LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy"),
              LMDraft(truncated_target(target, 2), "truncated:2"), LMDraft(other, "random")]
    accepted = {}
    for draft, spec in [(drafts[0], "chain:4"), (drafts[1], "chain:4"), (drafts[1], "chain:1"), (drafts[2], "chain:4")]:
        rows = assert_rows_match_one_at_a_time(target, draft, spec, GREEDY, eos, cases, 30, references)
        accepted[(draft.name, spec)] = sum(sum(r.accepted) for r in rows) / sum(r.rounds for r in rows)
    # acceptance was ragged for real: the copy accepts whole chains, the random model almost nothing
    assert accepted[("copy", "chain:4")] > 3.0 and accepted[("random", "chain:4")] < 1.0
    assert target_decode_batch(target, cases, 30, GREEDY, [stop]) == [target_generate(target, p, 30, GREEDY, [stop])
                                                                     for p in cases]


def test_batched_sampling_rows_reproduce_their_own_seeded_decode(tiny_llama_dir):
    target, _ = load(tiny_llama_dir)
    eos = stop_token_ids(target)
    cases = prompts(target.config.vocab_size, seed=1)
    copy = LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy")
    for params, draft in ((SamplingParams(0.8), LMDraft(truncated_target(target, 2), "truncated:2")),
                          (SamplingParams(1.0, top_p=0.9, top_k=20), copy)):
        assert_rows_match_one_at_a_time(target, draft, "chain:3", params, eos, cases, 25)


# peagle: the mask slots of every depth in one forward; dflash, dspark: every row's block in one forward (dspark: each
# node's children read its own token); mtp (chain feed): layer d for every row's depth-d nodes, each node's rows
# reading its parent's. (dspark over the reduced vocabulary: at T=1 one row's 28th draw lands 6e-8 from a CDF boundary,
# below the float noise between a batched and a single forward, so its rows agree only to that noise.)
HEADS = [("eagle3", True), ("eagle", False), ("peagle", True), ("dflash", True), ("dspark", False), ("mtp", False)]


@pytest.mark.parametrize("kind,reduced", HEADS, ids=[kind for kind, _ in HEADS])
def test_batched_head_draft_logits_equal_one_at_a_time(tmp_path, tiny_qwen2_dir, kind, reduced):
    """Start, three depths of tree nodes (1, 2 and 2 nodes per row, then children of different parents), a ragged
    commit (0, 1 and 2 accepted tokens, through different nodes), then a node again: every row's logits equal
    its one-at-a-time draft's for the same calls."""
    target, tokenizer = load(tiny_qwen2_dir)
    draft = load_head_draft(make_checkpoint(tmp_path / "ckpt", tiny_qwen2_dir, kind, "chain", reduced), target, tokenizer)
    generator = torch.Generator().manual_seed(5)
    lengths = [4, 17, 9]
    sequences = [torch.randint(3, target.config.vocab_size, (n + 6,), generator=generator) for n in lengths]
    with torch.inference_mode():
        features = [torch.cat([target(s[None], output_hidden_states=True).hidden_states[i][0]
                               for i in draft.feature_layers], dim=-1) for s in sequences]
        prompts_, roots = [s[:n].tolist() for s, n in zip(sequences, lengths)], [int(s[n]) for s, n in zip(sequences, lengths)]
        width = max(lengths)
        padded = torch.stack([torch.cat([f[:1].expand(width - n, -1), f[:n]]) for f, n in zip(features, lengths)])
        nxt = [(int(s[n + 1]), int(s[n + 2])) for s, n in zip(sequences, lengths)]
        # (parents, tokens) per row: node 0 is the sequence's next token, node 1 (rows 1, 2) another root child;
        # at depth 2 row 1 expands its second child first; row 2's node 2 is the sequence's token after node 0
        depth1 = [([-1], [nxt[0][0]]), ([-1, -1], [nxt[1][0], 99]), ([-1, -1], [nxt[2][0], 98])]
        depth2 = [([0], [nxt[0][1]]), ([1, 0], [55, nxt[1][1]]), ([0], [nxt[2][1]])]
        depth3 = [([1], [5]), ([3, 2], [6, 7]), ([2], [8])]  # (an mtp node 3 deep reads 2 rows of its parent's)
        accepted, kept = [[], [nxt[1][0]], list(nxt[2])], [[], [0], [0, 2]]
        new_roots = [int(s[n + 1 + len(a)]) for s, n, a in zip(sequences, lengths, accepted)]
        commit_features = [f[n:n + 1 + len(a)] for f, n, a in zip(features, lengths, accepted)]
        batch = batched_draft(draft, 4)  # trees 4 deep: nodes to expand at depths 1-3
        got = [batch.start(prompts_, roots, padded), batch.expand(depth1), batch.expand(depth2), batch.expand(depth3),
               batch.commit(kept, accepted, new_roots, commit_features),
               batch.expand([([-1], [7 + b]) for b in range(len(lengths))])]
        for b, n in enumerate(lengths):
            want = [draft.start(torch.tensor(prompts_[b]), roots[b], features[b][:n]), draft.expand(*depth1[b]),
                    draft.expand(*depth2[b]), draft.expand(*depth3[b]),
                    draft.commit(kept[b], accepted[b], new_roots[b], commit_features[b]), draft.expand([-1], [7 + b])]
            for step, (a, w) in enumerate(zip(got, want)):
                finite = torch.isfinite(w)
                assert a[b].shape == w.shape and torch.equal(torch.isfinite(a[b]), finite), f"{kind} row {b} call {step}"
                # fp32 over a batch runs other matmul shapes (kernels pick their blocking by shape): measured up to
                # 3.3e-5 on logits of magnitude 30 with AMX, so the tolerance is relative to the row's largest logit.
                scale = max(1.0, w[finite].abs().max().item())
                assert torch.allclose(a[b][finite], w[finite], atol=1e-5 * scale, rtol=1e-5), f"{kind} row {b} call {step}"


@pytest.mark.parametrize("kind,reduced", HEADS, ids=[kind for kind, _ in HEADS])
def test_batched_head_drafts_decode_exactly(tmp_path, tiny_qwen2_dir, kind, reduced):
    target, tokenizer = load(tiny_qwen2_dir)
    draft = load_head_draft(make_checkpoint(tmp_path / "ckpt", tiny_qwen2_dir, kind, "chain", reduced), target, tokenizer)
    eos = stop_token_ids(target)
    cases = prompts(target.config.vocab_size, seed=2)
    references = [target_generate(target, p, 20, GREEDY, eos) for p in cases]
    assert_rows_match_one_at_a_time(target, draft, "chain:3", GREEDY, eos, cases, 20, references)
    assert_rows_match_one_at_a_time(target, draft, "chain:3", SamplingParams(1.0), eos, cases, 20)


TREES = ["tree:[[0],[1],[0,0],[0,1],[1,0]]", "dynamic:depth=3,topk=2,nodes=5"]


def test_batched_trees_of_token_drafts_are_exact_per_row(tiny_llama_dir, tmp_path):
    """Trees: each row drafts its own tree with its own copy of the draft, and every row's tree is verified in one
    forward (each node at its root's position + depth, seeing its row's entries and its ancestors); each row keeps
    its root and accepted path. Rows stop at an EOS at different rounds."""
    target, _ = load(tiny_llama_dir)
    cases = prompts(target.config.vocab_size, seed=5)
    stop = target_generate(target, cases[3], 30, GREEDY, [])[7]
    references = [target_generate(target, p, 30, GREEDY, [stop]) for p in cases]
    assert min(len(r) for r in references) < 30 == max(len(r) for r in references)
    for draft in (LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy"),
                  LMDraft(truncated_target(target, 2), "truncated:2")):
        for spec in TREES:
            rows = assert_rows_match_one_at_a_time(target, draft, spec, GREEDY, [stop], cases, 30, references)
            if draft.name == "copy":  # paths deeper than one node were kept, in every row
                assert all(max(r.accepted) >= 2 for r in rows if r.accepted), spec
            assert_rows_match_one_at_a_time(target, draft, spec, SamplingParams(0.8), [stop], cases, 25)


# every head kind on trees, and mtp (its per-layer caches) on chains too: drafted in lockstep, verified together
TREE_HEADS = [("eagle3", "chain", True, TREES[1]), ("eagle", "chain", False, TREES[0]),
              ("peagle", "chain", True, TREES[0]), ("dflash", "chain", True, TREES[1]),
              ("dspark", "chain", False, TREES[0]), ("mtp", "chain", False, "chain:3"), ("mtp", "target", True, TREES[1])]


@pytest.mark.parametrize("kind,feed,reduced,spec", TREE_HEADS,
                         ids=["eagle3-dynamic", "eagle-tree", "peagle-tree", "dflash-dynamic", "dspark-tree", "mtp-chain",
                              "mtp-dynamic"])
def test_batched_head_drafts_on_trees_and_mtp_decode_exactly(tmp_path, tiny_qwen2_dir, kind, feed, reduced, spec):
    target, tokenizer = load(tiny_qwen2_dir)
    checkpoint = make_checkpoint(tmp_path / "ckpt", tiny_qwen2_dir, kind, feed, reduced)
    draft = load_head_draft(checkpoint, target, tokenizer)
    eos = stop_token_ids(target)
    cases = prompts(target.config.vocab_size, seed=6)
    references = [target_generate(target, p, 20, GREEDY, eos) for p in cases]
    assert_rows_match_one_at_a_time(target, draft, spec, GREEDY, eos, cases, 20, references)
    assert_rows_match_one_at_a_time(target, draft, spec, SamplingParams(1.0), eos, cases, 20)


@pytest.mark.slow  # about 35 s on one core of a 2-core AVX2-only EPYC: 16,000 rows
def test_batched_sampling_follows_the_target_distribution_per_row(tmp_path):
    """16,000 rows of one context: tokens 2 and 3 (drafted, verified with ragged acceptance) ~ the target's joint.

    The bound is the largest TV of 1,000 plain samplings of as many draws (test_eval_exact.tv_noise); until
    2026-12-06 it was TV < 0.01 over 40,000 rows, which cost 89 s. Measured: 1.09x the mean plain TV honest, 3.65x
    with a verifier drawing its uniforms x0.7. That every row is its own seeded one-at-a-time decode is checked
    exactly above."""
    target = tiny_vocab_target(tmp_path / "tiny_vocab")
    draft = LMDraft(truncated_target(target, 2), "truncated:2")
    params = SamplingParams(1.0)
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    n = len(CONTEXT)
    with torch.inference_mode():
        logits = target(torch.tensor([CONTEXT + [a, b] for a, b in pairs])).logits.float()
    first = process_logits(logits[0, n - 1], params)
    second = process_logits(logits[torch.arange(0, len(pairs), VOCAB), n], params)            # [a, t2]
    third = process_logits(logits[:, n + 1], params).view(VOCAB, VOCAB, VOCAB)             # [a, b, t3]
    exact = (first[:, None, None] * second[:, :, None] * third).sum(0)                      # joint of (t2, t3)
    decoder = BatchedDecoder(target, draft, parse_shape("chain:2"), params, eos_token_ids=[])
    counts, histogram, rows = torch.zeros(VOCAB * VOCAB), [0, 0, 0], 16_000
    for offset in range(0, rows, 4_000):
        for result in decoder.generate([CONTEXT] * 4_000, 3, seeds=list(range(offset, offset + 4_000))):
            counts[result.tokens[1] * VOCAB + result.tokens[2]] += 1
            histogram[result.accepted[0]] += 1
    spec_tv, (floor, bound) = tv(counts.view(VOCAB, VOCAB) / rows, exact), tv_noise(exact, rows)
    print(f"TV(batched, exact)={spec_tv:.4f}, {spec_tv / floor:.2f} x the floor {floor:.4f} (bound {bound:.4f}); "
          f"accepted 0/1/2: {histogram}")
    assert spec_tv <= bound
    assert min(histogram) > 400  # every acceptance count occurred in the same batches


def test_evaluate_batched_matches_one_at_a_time(tiny_llama_dir):
    target, tokenizer = load(tiny_llama_dir)
    items = [EncodedPrompt(Prompt(f"p{i}", "cat" if i % 2 else "dog", []), ids)
             for i, ids in enumerate(prompts(target.config.vocab_size, seed=4))]
    drafts = [LMDraft(truncated_target(target, 2), "truncated:2")]
    shapes = [parse_shape("chain:3"), parse_shape("tree:[[0],[1],[0,0]]")]
    one = evaluate(target, tokenizer, drafts, shapes, items, GREEDY, 24, progress=False)
    many = evaluate(target, tokenizer, drafts, shapes, items, GREEDY, 24, progress=False, batch_size=4)
    for a, b in zip(one["configs"], many["configs"]):
        for key in ("alpha", "accepted_histogram", "tokens", "rounds", "attempts", "accepts", "greedy_match"):
            assert a["overall"][key] == b["overall"][key], (a["label"], key)
        assert b["overall"]["greedy_match"] == {"matched": len(items), "compared": len(items)}
        assert b["overall"]["prompts_per_s"] > 0 and a["overall"]["prompts_per_s"] > 0
        assert b["per_category"]["cat"]["tokens"] == a["per_category"]["cat"]["tokens"]
    assert [c["batched"] for c in many["configs"]] == [True, True]
    assert many["baseline"]["overall"]["tokens"] == one["baseline"]["overall"]["tokens"]


def test_evaluate_checks_decodes_against_references_given_once(tiny_llama_dir):
    """`references` (the target's greedy outputs, decoded once by the caller) stand in for the baseline's: the
    same figures without decoding the target alone again, and a wrong reference is counted as a mismatch."""
    target, tokenizer = load(tiny_llama_dir)
    items = [EncodedPrompt(Prompt(f"p{i}", "cat", []), ids) for i, ids in enumerate(prompts(target.config.vocab_size, seed=4))]
    drafts, shapes = [LMDraft(truncated_target(target, 2), "truncated:2")], [parse_shape("chain:3")]
    eos = stop_token_ids(target, tokenizer)
    reference = target_decode_batch(target, [item.ids for item in items], 12, GREEDY, eos)
    checked = evaluate(target, tokenizer, drafts, shapes, items, GREEDY, 12, progress=False)
    for batch_size in (1, 4):
        given = evaluate(target, tokenizer, drafts, shapes, items, GREEDY, 12, progress=False, batch_size=batch_size,
                         baseline=False, references=reference)
        assert given["baseline"] is None
        for key in ("greedy_match", "tokens", "rounds", "accepts"):
            assert given["configs"][0]["overall"][key] == checked["configs"][0]["overall"][key], (batch_size, key)
        wrong = evaluate(target, tokenizer, drafts, shapes, items, GREEDY, 12, progress=False, batch_size=batch_size,
                         baseline=False, references=[ids[:-1] for ids in reference])
        assert wrong["configs"][0]["overall"]["greedy_match"] == {"matched": 0, "compared": len(items)}
    with pytest.raises(ValueError, match="references for"):
        evaluate(target, tokenizer, drafts, shapes, items, GREEDY, 12, baseline=False, references=reference[:1])


def test_batch_size_must_be_positive(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: r}\n")
    with pytest.raises(EyasError, match="'eval.batch_size' must be > 0"):
        load_recipe(recipe, ["eval.batch_size=0"])
