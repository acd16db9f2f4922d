"""Training for a tree (train/ttt.py `TreeLevers`, the `topk` loss term): each lever does what its definition says,
on a tiny head, against a computation from the unroll's own logits; the recipe refuses a lever where it would change
nothing; and (`pytest -m quality`) the topk term and the align mask each raise the figure they target at equal steps
on held-out shards against the same run without them (the sibling feed: see the note after those tests)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import draft_cfg, synthetic_batch, tiny_d2t, tiny_target_config

from eyas.config import load_recipe
from eyas.draft.registry import build_head
from eyas.errors import EyasError
from eyas.recipe_checks import parse_loss_mix, tree_width
from eyas.train.losses import Teacher, position_losses, step_losses, top_k_distillation
from eyas.train.ttt import TreeLevers, _reference_rank, teacher_for, unroll

STEPS = 3


def test_the_topk_term_is_top_k_distillation_over_the_teachers_most_likely_tokens():
    g = torch.Generator().manual_seed(0)
    teacher_logits, draft_logits = torch.randn(6, 11, generator=g) * 2, torch.randn(6, 11, generator=g) * 2
    logp, logq = teacher_logits.log_softmax(-1), draft_logits.log_softmax(-1)
    p = logp.exp()
    top = p.topk(3, dim=-1).indices
    want = torch.stack([-(p[i, top[i]] * logq[i, top[i]]).sum() for i in range(6)])
    torch.testing.assert_close(top_k_distillation(p, logq, 3), want)
    # K = the vocabulary: the soft cross-entropy, i.e. forward KL plus the teacher's entropy
    torch.testing.assert_close(top_k_distillation(p, logq, 11), -(p * logq).sum(-1))
    labels = torch.arange(6)
    mix = parse_loss_mix("forward_kl:1,topk:0.5")
    torch.testing.assert_close(step_losses(draft_logits, p, (p * logp).sum(-1), labels, mix, topk=3),
                               position_losses(draft_logits, logp, labels, mix, topk=3))
    torch.testing.assert_close(position_losses(draft_logits, logp, labels, mix, topk=3),
                               position_losses(draft_logits, logp, labels, "forward_kl") + 0.5 * want)


def _recorded_unroll(levers: TreeLevers, kind: str = "eagle3", ranks: int = 0):
    """An unroll of a tiny head with every step's input tokens and logits recorded."""
    torch.manual_seed(7)
    head = build_head(draft_cfg(kind), tiny_target_config(), d2t=tiny_d2t())
    teacher = Teacher(torch.randn(384, 64) * 3, tiny_d2t(), chunk=8)
    batch = synthetic_batch(seq=24, seed=3)
    seen = []
    step = head.step

    def recording(k, tokens, feature, positions, past_key_values=None):
        hidden, logits = step(k, tokens, feature, positions, past_key_values=past_key_values)
        seen.append((tokens.clone(), logits.detach().clone()))
        return hidden, logits

    head.step = recording
    out = unroll(head, batch, teacher, STEPS, {"forward_kl": 1.0}, levers=levers, ranks=ranks)
    return head, teacher, batch, out, seen


def test_the_sibling_feed_reads_the_targets_token_where_the_draft_ranked_it_within_the_width():
    width = 4
    head, teacher, batch, _, seen = _recorded_unroll(TreeLevers(width, follow=True))
    reference = teacher_for(batch, teacher).top
    followed = 0
    for k in range(STEPS - 1):
        logits = seen[k][1]
        length = logits.shape[1] - k - 2
        ref = reference[:, k + 1:k + 1 + length]
        rank = _reference_rank(logits[:, :length], ref)
        drafted = logits.argmax(-1)
        want = drafted.clone()
        want[:, :length] = torch.where(rank < width, ref, drafted[:, :length])
        assert torch.equal(seen[k + 1][0], head.draft_to_target(want))
        followed += int(((rank < width) & (rank > 0)).sum())  # a second choice or lower followed
    assert followed > 0  # the check above compared a feed that differs from the argmax somewhere
    # width 1: the draft feed itself
    _, _, _, plain, plain_seen = _recorded_unroll(TreeLevers())
    _, _, _, one, one_seen = _recorded_unroll(TreeLevers(1, follow=True))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain_seen, one_seen))
    assert [float(s) for s in plain.loss_sums] == [float(s) for s in one.loss_sums]


def test_the_align_mask_scores_a_slot_only_while_every_earlier_step_ranked_the_targets_token_within_the_width():
    width = 2
    _, teacher, batch, masked, seen = _recorded_unroll(TreeLevers(width, align=True), ranks=width)
    _, _, _, plain, plain_seen = _recorded_unroll(TreeLevers(width), ranks=width)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(seen, plain_seen))  # the mask changes no forward
    dist = teacher_for(batch, teacher)
    loss_mask = batch["loss_mask"].float() * batch["attention_mask"].float()
    labels = teacher.to_draft_ids(batch["input_ids"])
    reached = torch.ones_like(loss_mask)
    for k, (_, logits) in enumerate(seen):
        length = logits.shape[1] - k - 2
        span = slice(k + 1, k + 1 + length)
        per_slot = step_losses(logits[:, :length], dist.probs[:, span], dist.plogp[:, span], labels[:, k + 2:],
                               {"forward_kl": 1.0})
        weight = loss_mask[:, k + 2:]
        torch.testing.assert_close(masked.loss_sums[k], (per_slot * weight * reached[:, :length]).sum())
        assert float(masked.counts[k]) == float(plain.counts[k]) == float(weight.sum())
        rank = _reference_rank(logits[:, :length], dist.top[:, span]).clamp(max=width)
        # the ranks are counted where the mask still scores (a tree's rates at depth k over the positions its branch
        # reached: what the held-out eval's tree pass reports), the plain unroll's over every position
        for counted, where in ((masked, weight * reached[:, :length]), (plain, weight)):
            want = torch.stack([(where * (rank == r)).sum() for r in range(width + 1)])
            torch.testing.assert_close(counted.rank_counts[k], want)
        reached[:, :length] *= (rank < width).float()
    assert float(masked.loss_sums[-1]) < float(plain.loss_sums[-1])  # something was masked
    assert float(masked.rank_counts[-1].sum()) < float(plain.rank_counts[-1].sum())


def test_the_recipe_refuses_a_sibling_feed_that_would_change_nothing(tiny_llama_dir):
    base = [f"target.path={tiny_llama_dir}", "train.sibling_feed=true"]
    tree = "train.select_shape=dynamic:depth=3,topk=4,nodes=8"
    assert tree_width(load_recipe(None, [*base, tree])) == 4
    assert tree_width(load_recipe(None, [*base, tree, "train.tree_width=2"])) == 2
    with pytest.raises(EyasError, match="but W is 1 .* which is the draft feed itself"):
        load_recipe(None, [*base, "eval.shapes=[\"chain:4\"]"])
    with pytest.raises(EyasError, match="a mtp draft's steps read the data's tokens"):
        load_recipe(None, [*base, tree, "draft.kind=mtp", "draft.num_steps=3", "train.ttt_steps=3"])
    assert load_recipe(None, [*base, tree, "draft.kind=mtp", "draft.num_steps=3", "train.ttt_steps=3",
                              "train.ttt_token_feed=draft"]).train.sibling_feed
    for kind in ("peagle", "dflash"):
        with pytest.raises(EyasError, match=f"a {kind} draft's steps read no drafted token"):
            load_recipe(None, [*base, tree, f"draft.kind={kind}", "draft.num_steps=3", "train.ttt_steps=3"])
    with pytest.raises(EyasError, match="'train.tree_width' must be >= 0"):
        load_recipe(None, [f"target.path={tiny_llama_dir}", "train.tree_width=-1"])


# -- each lever raises the figure it targets, at equal steps on held-out shards ------------------------------------

TREE = "dynamic:depth=3,topk=4,nodes=12"


@pytest.fixture(scope="module")
def levers_workspace(tmp_path_factory, tiny_llama_dir):
    """800 chitchat conversations on the tiny target, a quarter held out (about 2,700 scored positions a step),
    the full vocabulary; one draft trained per lever on request, each from the same init over the same batches."""
    from train_helpers import make_workspace

    root = tmp_path_factory.mktemp("tree_levers")
    make_workspace(root, tiny_llama_dir, 800, "data.heldout_fraction=0.25", "dump.draft_vocab_size=0",
                   "dump.shard_tokens=4000", "dump.token_budget=800")
    return {"root": root, "target": tiny_llama_dir, "held_out": {}}


def _held_out(ws: dict, name: str, *overrides: str) -> dict:
    """The last held-out eval of a 300-step eagle3 run of the workspace with `overrides` (trained once)."""
    import json

    from train_helpers import new_run

    from eyas.train.loop import train

    if name not in ws["held_out"]:
        new_run(ws, name)
        train(load_recipe(None, [
            f"target.path={ws['target']}", f"run.output_dir={ws['root']}", "dump.draft_vocab_size=0", f"run.name={name}",
            "train.token_budget=800", "train.max_steps=300", "train.ttt_steps=3", "train.lr=1e-3", "train.warmup_steps=5",
            "train.save_every=0", "train.eval_every=0", "train.eval_batches=100", "train.log_every=100",
            f"train.select_shape={TREE}", *overrides]))
        rows = [json.loads(line) for line in (ws["root"] / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        ws["held_out"][name] = [row for row in rows if row["kind"] == "eval"][-1]
    return ws["held_out"][name]


def _mean_cover(metrics: dict) -> float:
    return sum(metrics[f"cover_{k}"] for k in range(STEPS)) / STEPS


@pytest.mark.quality
def test_the_topk_term_raises_the_teachers_probability_on_the_drafts_top_w(levers_workspace):
    base, lever = _held_out(levers_workspace, "no-lever"), _held_out(levers_workspace, "topk", "train.loss=forward_kl:1,topk:4")
    assert base["cover_width"] == lever["cover_width"] == 4
    assert _mean_cover(lever) > _mean_cover(base) + 0.003  # measured: +0.0074 (seed 1: +0.0077)


@pytest.mark.quality
def test_the_align_mask_raises_the_simulated_tree_acceptance(levers_workspace):
    base, lever = _held_out(levers_workspace, "no-lever"), _held_out(levers_workspace, "align", "train.align_mask=true")
    assert lever["select_accept"] > base["select_accept"] + 0.01  # measured: +0.036 (seed 1: +0.023)


# The sibling feed has no test here: on this tiny target it raises no figure beyond the runs' noise. Against the same
# run without it, the tree's figure moved +0.0001 and +0.0033 (seeds 0, 1) at width 4 and +0.0025 and +0.014 at
# width 8; beside the align mask +0.0074, +0.0083, +0.0019 and -0.0007 (seeds 0-3). (Before the eval counted a
# tree's rates over the positions its branch reaches, a +0.015 gain at width 8 came from positions no tree
# verifies.) Its gain is SmolLM2's, measured in eyas's decoder: docs/results.md, "Training for a tree".
