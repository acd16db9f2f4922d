"""The dspark head (DFlash's block with its anchor row predicting, a Markov bias from the token before each draft and
a confidence per draft): training and eval are one computation, decoding is lossless on chains and trees (each
child conditioned on its own parent) at T=0 and T>0, training learns the drafts and the confidence, the recipe
gives DSpark's published loss, and the vLLM (speculators) export round-trips and is read by vLLM's own parser.

Batched drafting (every row's block in one forward) is in `tests/test_eval_batched.py` (its HEADS and TREE_HEADS).
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import random_head, target_batch
from safetensors import safe_open
from test_eval_exact import VOCAB, check_exact, tiny_vocab_target

from eyas.config import from_dict
from eyas.decode import SamplingParams, stop_token_ids
from eyas.draft.checkpoint import load_draft, save_draft
from eyas.draft.features import default_layers
from eyas.draft.registry import build_head
from eyas.errors import EyasError
from eyas.eval.decoder import SpeculativeDecoder, target_generate
from eyas.eval.head_draft import BlockDraft, load_head_draft
from eyas.recipe_checks import parse_loss_mix
from eyas.recipe_kinds import draft_config
from eyas.shapes import parse_shape
from eyas.train.export import export_draft, load_exported
from eyas.train.losses import Teacher
from eyas.train.ttt import block_steps, unroll

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
STEPS = 3  # drafts per block: the anchor row and two mask rows


def _sharpen_markov(head, scale: float = 30.0) -> None:
    """A random Markov bias is ~1e-3 (two 0.02-std factors): scaled so that it changes which token is drafted."""
    with torch.no_grad():
        head.markov_head.markov_w1.weight.mul_(scale)
        head.markov_head.markov_w2.weight.mul_(scale)


def _head(target_dir, layers: int = 1, reduced: bool = False, seed: int = 0):
    d2t = None
    if reduced:
        kept = torch.randperm(384, generator=torch.Generator().manual_seed(seed))[:200].sort().values
        d2t = kept - torch.arange(len(kept))
    head, target, tokenizer = random_head(target_dir, "dspark", d2t, seed, num_steps=STEPS, num_layers=layers,
                                          markov_rank=16)
    _sharpen_markov(head)
    return head, target, tokenizer


def _features(target, sequence, layers):
    with torch.inference_mode():
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in layers], dim=-1)


def test_block_draft_equals_the_training_forward(tiny_llama_dir):
    """The eval adapter after root x_L, each node holding the data's token, gives the logits and confidences the
    training forward gives every step of the block anchored at L; a node with another token gets other logits (the
    Markov head reads it); and the chain is as deep as the block's rows."""
    head, target, _ = _head(tiny_llama_dir, layers=2)
    draft = BlockDraft(head.eval(), "dspark")
    sequence = torch.randint(3, target.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    features = _features(target, sequence, draft.feature_layers)
    L = 12
    with torch.inference_mode():
        train = block_steps(head, sequence[None], features[None], STEPS)
        got = [draft.start(sequence[:L], int(sequence[L]), features[:L])]
        rows = draft.rows  # the block's predicting rows after root x_L
        got += [draft.expand([d - 2], [int(sequence[L + d])])[0] for d in range(1, STEPS)]
        other = draft.expand([-1], [int(sequence[L + 1]) + 1])[0]
        after = draft.commit([0, 1], [int(sequence[L + 1]), int(sequence[L + 2])], int(sequence[L + 3]),
                             features[L:L + 3])
    for k in range(STEPS):
        torch.testing.assert_close(got[k], train[k][0][0, L - 1], atol=1e-4, rtol=1e-4)
    confidence = head.slot_confidence(rows, sequence[L:L + STEPS])
    torch.testing.assert_close(confidence, torch.stack([train[k][1][0, L - 1] for k in range(STEPS)]), atol=1e-4,
                               rtol=1e-4)
    assert (other - got[1]).abs().max() > 0.1  # the same row read with another parent token
    torch.testing.assert_close(after, train[0][0][0, L + 2], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        for d in range(1, STEPS):  # a chain as deep as the block, after the commit
            draft.expand([d - 2], [7])
    with pytest.raises(EyasError, match="drafts 3 tokens per block"):
        draft.expand([STEPS - 2], [7])


@pytest.mark.parametrize("layers, reduced", [(1, False), (2, True)])
def test_greedy_with_dspark_equals_target_greedy(tmp_path, tiny_qwen2_dir, layers, reduced):
    """T=0: chains and trees (static and dynamic: siblings' children differ through the Markov head) emit the
    target's own greedy tokens, also from a checkpoint read back (its Markov rank in config.json)."""
    head, target, tokenizer = _head(tiny_qwen2_dir, layers=layers, reduced=reduced)
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0})
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["kind_options"] == {"markov_rank": 16} and config["format_version"] == 3
    draft = load_head_draft(checkpoint, target, tokenizer, target_path=str(tiny_qwen2_dir))
    eos = stop_token_ids(target)
    generator = torch.Generator().manual_seed(2)
    for n_prompt, n_new in ((5, 20), (23, 31)):
        prompt = torch.randint(3, target.config.vocab_size, (n_prompt,), generator=generator)
        reference = target_generate(target, prompt, n_new, GREEDY, eos)
        for spec in ("chain:1", "chain:3", "tree:[[0],[1],[0,0],[1,0],[0,0,0]]", "dynamic:depth=3,topk=2,nodes=6"):
            result = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate(prompt, n_new)
            assert result.tokens == reference, spec


def test_sampling_with_dspark_follows_the_target_distribution(tmp_path):
    """T=1 on a 16-token target: the joint of the first two emitted tokens, drafted by a DSpark head on a static
    tree (each child read with its parent's token), is as near the target's exact joint as plain draws are (the
    method of tests/test_eval_exact.py, over the head's own draft logits for every continuation)."""
    target = tiny_vocab_target(tmp_path / "tiny")
    torch.manual_seed(0)
    head = build_head(draft_config(kind="dspark", num_steps=3, markov_rank=8, mask_token_id=15), target.config,
                      default_layers(target.config.num_hidden_layers))
    head.init_from_target(target)
    _sharpen_markov(head, 60.0)
    draft = BlockDraft(head.eval(), "dspark")
    context = torch.tensor([3, 7, 1, 12, 5, 9])
    n = len(context)
    pairs = [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
    with torch.inference_mode():
        logits = target(torch.tensor([context.tolist() + [a, b] for a, b in pairs])).logits.float()
        features = _features(target, context, draft.feature_layers)
        draft_table = {(): draft.start(context[:-1], int(context[-1]), features[:-1])}
        for a in range(VOCAB):
            draft_table[(a,)] = draft.expand([-1], [a])[0]
            node = len(draft.nodes) - 1
            for b in range(VOCAB):
                draft_table[(a, b)] = draft.expand([node], [b])[0]
                draft.nodes.pop()
    target_table = {(): logits[0, n - 1]}
    for row, (a, b) in enumerate(pairs):
        target_table[(a,)], target_table[(a, b)] = logits[row, n], logits[row, n + 1]
    assert (draft_table[(0,)] - draft_table[(1,)]).abs().max() > 0.5  # siblings' children differ
    check_exact((target, target_table, draft_table), "tree:[[0],[1],[0,0],[1,0]]", SamplingParams(1.0))


def test_training_lowers_every_step_and_the_confidence_error(tiny_llama_dir):
    """A few AdamW steps on one batch with DSpark's recipe loss: every step's loss falls, and the confidence learns
    each draft's acceptance rate 1 - tv(draft, target) (its mean error falls below half)."""
    head, target, _ = _head(tiny_llama_dir)
    sequence = torch.randint(3, target.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    batch = target_batch(target, sequence, head.config.aux_layers)
    teacher = Teacher(target.get_output_embeddings().weight, None, 64)
    mix = parse_loss_mix(from_dict({"draft": {"kind": "dspark"}}).train.loss)
    optimizer = torch.optim.AdamW(head.trainable_parameters(), lr=3e-3)
    probs = teacher.distribution(batch["last_hidden"]).probs

    def losses() -> tuple[list[float], object]:
        out = unroll(head, batch, teacher, STEPS, mix)
        return [float(s / c) for s, c in zip(out.loss_sums, out.counts)], out

    def confidence_errors() -> list[float]:
        errors = []
        with torch.no_grad():
            for k, (logits, confidence) in enumerate(block_steps(head, batch["input_ids"], batch["aux_hidden"], STEPS)):
                n = logits.shape[1] - k - 2  # slots whose teacher exists
                accept = 1 - 0.5 * (probs[:, k + 1:k + 1 + n] - logits[:, :n].softmax(-1)).abs().sum(-1)
                errors.append(float((confidence[:, :n].sigmoid() - accept).abs().mean()))
        return errors

    before, errors_before = losses()[0], confidence_errors()
    for _ in range(40):
        _, out = losses()
        sum(s / c for s, c in zip(out.loss_sums, out.counts)).backward()
        optimizer.step()
        optimizer.zero_grad()
    after, errors_after = losses()[0], confidence_errors()
    assert all(a < 0.8 * b for a, b in zip(after, before)), (before, after)
    assert all(a < 0.5 * b for a, b in zip(errors_after, errors_before)), (errors_before, errors_after)
    assert not head.mask_embedding.requires_grad  # the mask rows keep the target's row, as vLLM gives them


def test_recipe_gives_dspark_its_published_training():
    recipe = from_dict({"draft": {"kind": "dspark", "num_steps": 7}})
    assert recipe.train.loss == "ce:0.1,tv:0.9,confidence:1.0" and recipe.train.ttt_decay == 0.7788
    assert recipe.train.ttt_steps == 7  # every row trains
    own = from_dict({"draft": {"kind": "dspark"}, "train": {"loss": "forward_kl"}})
    assert own.train.loss == "forward_kl" and own.train.ttt_decay == 0.7788
    with pytest.raises(EyasError, match=r"'confidence' term, but a dflash draft has no part it scores \(a dspark draft has one\)"):
        from_dict({"draft": {"kind": "dflash"}, "train": {"loss": "tv,confidence:1"}})
    with pytest.raises(EyasError, match="'draft.train_mask_embedding' is false, but a DSpark draft has no mask vector"):
        from_dict({"draft": {"kind": "dspark", "train_mask_embedding": False}})
    with pytest.raises(EyasError, match="'draft.markov_rank' must be > 0"):
        from_dict({"draft": {"kind": "dspark", "markov_rank": 0}})
    with pytest.raises(EyasError, match="block slots 3-4 would get no gradient"):
        from_dict({"draft": {"kind": "dspark", "num_steps": 4}, "train": {"ttt_steps": 2}})


def _assert_same_blocks(head, back, target, seed: int) -> None:
    """`back` (a read-back export of `head`) gives the head's own logits and confidences on a random row."""
    sequence = torch.randint(3, target.config.vocab_size, (16,), generator=torch.Generator().manual_seed(seed))
    features = _features(target, sequence, head.config.aux_layers)
    with torch.inference_mode():
        for (a, ca), (b, cb) in zip(block_steps(head, sequence[None], features[None], STEPS),
                                    block_steps(back, sequence[None], features[None], STEPS)):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(ca, cb)


def test_vllm_export_round_trips_and_vllm_parses_it(tmp_path, tiny_llama_dir):
    """`eyas export --to vllm` writes speculators' dspark format: vLLM's own speculators reader turns it into its
    DSpark model config (block K, the anchor sampled, the Markov rank, the confidence head on [h; W1]) and a dspark
    speculative config; the weights are DFlash's plus the Markov and confidence heads, without the mask vector or
    embedding; reading it back gives the head's own logits and confidences."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    head, target, _ = _head(tiny_llama_dir, layers=2, reduced=True)
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0, "target_path": str(tiny_llama_dir)})
    out = export_draft(checkpoint, "vllm", tmp_path / "vllm", dtype="float32", speculative_tokens=STEPS)
    config = json.loads((out / "config.json").read_text())
    parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(dict(config))
    assert parsed["architectures"] == ["Qwen3DSparkModel"] and parsed["model_type"] == "qwen3"
    assert parsed["sample_from_anchor"] and not parsed["dspark_bonus_anchor"] and parsed["block_size"] == STEPS
    assert parsed["target_layer_ids"] == [i - 1 for i in head.config.aux_layers]
    assert parsed["markov_rank"] == 16 and parsed["enable_confidence_head"] and parsed["confidence_head_with_markov"]
    assert parsed["draft_vocab_size"] == 200 and parsed["mask_token_id"] == head.config.mask_token_id
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == {"method": "dspark",
                                                                         "num_speculative_tokens": STEPS}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "lm_head.weight", "d2t", "fc.weight"} <= names
    assert not {"embed_tokens.weight", "mask_embedding"} & names and not list(out.glob("*.pt"))
    _assert_same_blocks(head, load_exported(out, target.get_input_embeddings().weight), target, seed=4)
    with pytest.raises(EyasError, match="trained with blocks of 3 drafts"):
        export_draft(checkpoint, "vllm", tmp_path / "deep", dtype="float32", speculative_tokens=STEPS + 1)
    reloaded, _ = load_draft(checkpoint)
    assert reloaded.config == head.config


def test_a_draft_saved_as_speculators_saves_it_reads_back(tmp_path, tiny_llama_dir):
    """speculators 0.9's own save_pretrained names its model class (DSparkDraftModel) as the architecture, writes
    the layer's rotary settings only as transformers 5's rope_parameters, and has no `eyas` block: eyas's reader
    takes such a folder (what bench_peer_speculators --kind dspark decodes) and gives the head's own logits."""
    head, target, _ = _head(tiny_llama_dir, layers=1, reduced=True)
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0, "target_path": str(tiny_llama_dir)})
    out = export_draft(checkpoint, "vllm", tmp_path / "vllm", dtype="float32", speculative_tokens=STEPS)
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    theta = layer.pop("rope_theta")
    layer.pop("rope_scaling", None)
    layer["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    config["architectures"] = ["DSparkDraftModel"]
    del config["eyas"]
    (out / "config.json").write_text(json.dumps(config))
    back = load_exported(out, target.get_input_embeddings().weight)
    assert back.config.rope_parameters == head.config.rope_parameters
    _assert_same_blocks(head, back, target, seed=5)
    del layer["rope_parameters"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match="neither rope_theta nor rope_parameters.rope_theta"):
        load_exported(out, target.get_input_embeddings().weight)


# ----------------------------------------------------------------------------- chains cut by the confidence


def test_confidence_shapes_parse_and_refuse_drafts_without_one(tmp_path, tiny_llama_dir):
    """`chain:K,confidence=C` parses, is refused for drafts without a confidence, and is not handed to vLLM (whose
    confidence-driven length is CUDA-only), nor is a dspark draft."""
    from eyas.eval.engine_vllm import resolve_engine, served_without_plugin

    assert parse_shape("chain:5,confidence=0.4").confidence == 0.4 and parse_shape("chain:5").confidence == 0.0
    assert "no chain:K shape" in resolve_engine("auto", [], [parse_shape("chain:3,confidence=0.5")], 0.0)[1]
    assert not served_without_plugin("dspark") and served_without_plugin("dflash")
    for bad in ("chain:5,confidence=1.5", "chain:5,conf=0.3", "chain:5,confidence=x", "chain:5,"):
        with pytest.raises(EyasError, match="a chain takes confidence=C after K"):
            parse_shape(bad)
    head, target, tokenizer = random_head(tiny_llama_dir, "dflash", num_steps=STEPS)
    draft = load_head_draft(save_draft(tmp_path / "dflash", head, {"step": 0}), target, tokenizer)
    prompt = torch.arange(3, 9)
    refused = (r"shape 'chain:3,confidence=0.5' cuts the chain by the draft's confidence, which draft '.+' does not "
               r"give \(a dspark draft does\); use chain:K")
    assert not draft.gives_confidence
    with pytest.raises(EyasError, match=refused):  # one check, in the decoder, for every draft without one
        SpeculativeDecoder(target, draft, parse_shape("chain:3,confidence=0.5"), GREEDY, []).generate(prompt, 8)
    from eyas.eval.drafts import LMDraft, truncated_target

    with pytest.raises(EyasError, match=refused):
        SpeculativeDecoder(target, LMDraft(truncated_target(target, 2), "truncated:2"),
                           parse_shape("chain:3,confidence=0.5"), GREEDY, [])


def test_greedy_chains_cut_by_confidence_equal_target_greedy(tmp_path, tiny_qwen2_dir):
    """T=0: a chain cut where the running product of confidences falls below C emits the target's greedy tokens,
    one at a time and batched (each row cut by its own confidences), verifying fewer drafts than the fixed chain;
    a C no product falls below verifies them all."""
    from eyas.eval.batched import BatchedDecoder

    head, target, tokenizer = _head(tiny_qwen2_dir)
    with torch.no_grad():
        head.confidence_head.proj.weight.normal_(0, 0.2)  # confidences spread over (0, 1), so cuts vary
    draft = load_head_draft(save_draft(tmp_path / "ckpt", head, {"step": 0}), target, tokenizer)
    eos = stop_token_ids(target)
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 11, 17)]
    references = [target_generate(target, p, 24, GREEDY, eos) for p in prompts]
    sizes = {}
    for spec in ("chain:3", "chain:3,confidence=1e-9", "chain:3,confidence=0.3"):
        one = [SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate(p, 24) for p in prompts]
        batch = BatchedDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate([p.tolist() for p in prompts], 24)
        for ref, a, b in zip(references, one, batch):
            assert a.tokens == ref and b.tokens == ref, spec
            assert a.tree_sizes == b.tree_sizes, spec
        sizes[spec] = [s for r in one for s in r.tree_sizes]
    assert sizes["chain:3,confidence=1e-9"] == sizes["chain:3"] and set(sizes["chain:3"]) == {3}
    assert 1 in sizes["chain:3,confidence=0.3"] and max(sizes["chain:3,confidence=0.3"]) > 1


def test_sampled_chains_cut_by_confidence_follow_the_target_distribution(tmp_path):
    """T=1 on a 16-token target: chain:3 cut by the DSpark head's own confidences (each draft's from its parent's
    token), with C set so that rounds verify 1, 2 or 3 drafts; the joint of the first two emitted tokens is
    as near the target's exact joint as plain draws are (the method of tests/test_eval_exact.py)."""
    from test_eval_exact import SAMPLES, assert_near_exact, exact_joint, sample_joint

    from eyas.decode import process_logits
    from eyas.eval.tree import build_tree, confident_chain
    from eyas.eval.verify import verify_sampled

    target = tiny_vocab_target(tmp_path / "tiny")
    torch.manual_seed(0)
    head = build_head(draft_config(kind="dspark", num_steps=3, markov_rank=8, mask_token_id=15), target.config,
                      default_layers(target.config.num_hidden_layers))
    head.init_from_target(target)
    _sharpen_markov(head, 15.0)  # a bias that matters, not one that fixes every draft
    with torch.no_grad():
                # a confidence read from the previous token alone, spread over (0, 1) (the hidden part would saturate it)
        head.confidence_head.proj.weight.zero_()
        head.confidence_head.proj.weight[0, head.config.hidden_size:].normal_(0, 1.5)
    draft = BlockDraft(head.eval(), "dspark")
    context = torch.tensor([3, 7, 1, 12, 5, 9])
    n = len(context)
    with torch.inference_mode():
        triples = [(a, b, c) for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)]
        logits = target(torch.tensor([context.tolist() + list(t) for t in triples])).logits.float()
        draft_table = {(): draft.start(context[:-1], int(context[-1]), _features(target, context, draft.feature_layers)[:-1])}
        for a in range(VOCAB):
            draft_table[(a,)] = draft.expand([-1], [a])[0]
            for b in range(VOCAB):
                draft_table[(a, b)] = draft.expand([len(draft.nodes) - 1], [b])[0]
                draft.nodes.pop()
        # draft k's confidence reads the token before it: the root's for the first, then a, then b
        first = draft.chain_confidence([0])[0]
        after_a = [draft.chain_confidence([a, 0])[1] for a in range(VOCAB)]
        after_b = [draft.chain_confidence([0, b, 0])[2] for b in range(VOCAB)]
    target_table = {(): logits[0, n - 1]}
    for row, (a, b, c) in enumerate(triples):
        target_table[(a,)], target_table[(a, b)], target_table[(a, b, c)] = logits[row, n], logits[row, n + 1], \
            logits[row, n + 2]
    params, generator, lengths = SamplingParams(1.0), torch.Generator().manual_seed(1234), []

    def expand(parents, tokens, contexts=[]):  # noqa: B006 (the round's node contexts, reset per round)
        if parents[0] < 0:
            contexts.clear()
        rows = []
        for parent, token in zip(parents, tokens):
            contexts.append((contexts[parent] if parent >= 0 else ()) + (token,))
            rows.append(draft_table[contexts[-1]])
        return torch.stack(rows)

    def products(tokens: list[int]) -> list[float]:  # the running products of the chain's confidences
        return [first * after_a[tokens[1]], first * after_a[tokens[1]] * after_b[tokens[2]]]

    # C where the draft's own chains (2,000 drawn apart) most evenly verify 1, 2 and 3 drafts
    probe = torch.Generator().manual_seed(7)
    chains = [products(build_tree(parse_shape("chain:3"), int(context[-1]), draft_table[()], expand, params,
                                  probe).tokens) for _ in range(2000)]

    def fewest(c: float) -> int:  # the rarest length's count at threshold c
        kept = [1 + (p2 >= c) + (p2 >= c and p3 >= c) for p2, p3 in chains]
        return min(kept.count(k) for k in (1, 2, 3))

    threshold = max(sorted({v for chain in chains for v in chain})[::20], key=fewest)

    def one_round() -> list[int]:
        tree = build_tree(parse_shape("chain:3"), int(context[-1]), draft_table[()], expand, params, generator)
        tree = confident_chain(tree, [first, after_a[tree.tokens[1]], after_b[tree.tokens[2]]], threshold)
        lengths.append(len(tree) - 1)
        paths = [tuple(tree.tokens[1:i + 1]) for i in range(len(tree))]
        probs = torch.stack([process_logits(target_table[p], params) for p in paths])
        path, bonus = verify_sampled(tree.children, tree.tokens, probs, tree.child_q, generator)
        return tree.path_tokens(path) + [bonus]

    joint = sample_joint(one_round, target_table, params, generator)
    print(f"confidence chain: lengths 1/2/3: {[lengths.count(k) for k in (1, 2, 3)]} of {SAMPLES}")
    assert_near_exact("confidence chain", joint, exact_joint(target_table, params))
    # the cut moved with the drafts: after the second (its confidence reads the first draft's token) and the third
    assert min(lengths.count(2), lengths.count(3)) > SAMPLES // 20 and lengths.count(1) > 0
