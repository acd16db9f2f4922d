"""The peagle head (EAGLE-3 drafting every step from mask slots): the eval adapter replays the training
unroll with the mask inputs, decoding is lossless one at a time and batched, training moves the mask
feature, and the vLLM export carries what vLLM's parallel drafting reads.

vLLM serving it with eyas's acceptance is `tests/test_vllm_parity.py::test_vllm_serves_the_peagle_export`.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import random_head, target_batch
from safetensors import safe_open

from eyas.decode import SamplingParams, stop_token_ids
from eyas.draft.blocks import TTTCache
from eyas.draft.checkpoint import save_draft
from eyas.eval.batched import BatchedDecoder
from eyas.eval.decoder import SpeculativeDecoder, target_generate
from eyas.eval.head_draft import head_draft, load_head_draft
from eyas.recipe_checks import parse_loss_mix
from eyas.shapes import parse_shape
from eyas.train.export import export_draft, load_exported, serve_command
from eyas.train.losses import Teacher
from eyas.train.ttt import unroll

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)


def _head(target_dir, seed: int = 0):
    """A random peagle head on the target in `target_dir`, sharpened, with a random mask feature."""
    head, target, tokenizer = random_head(target_dir, "peagle", seed=seed)
    with torch.no_grad():
        head.mask_hidden.normal_()
    return head, target, tokenizer


def test_adapter_replays_the_unroll_with_mask_inputs(tiny_llama_dir):
    """Steps 1..3 through the adapter read the mask token and fc(mask_hidden) whatever was drafted, and give
    the logits of the training unroll at the last slot."""
    head, target, _ = _head(tiny_llama_dir)
    draft = head_draft(head.eval(), "peagle")
    sequence = torch.randint(3, target.config.vocab_size, (17,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i][0] for i in draft.feature_layers], dim=-1)
        L = 16
        got = [draft.start(sequence[:L], int(sequence[L]), features[:L])]
        got += [draft.expand([d - 2], [5])[0] for d in range(1, 4)]
        tokens, feature, cache, want = sequence[1:L + 1][None], head.project(features[:L][None]), TTTCache(), []
        for k in range(4):
            step_hidden, logits = head.step(k, tokens, feature, torch.arange(L)[None] + k, past_key_values=cache)
            want.append(logits[0, -1])
            tokens, feature = head.mask_slots(tokens, step_hidden)
    assert torch.equal(tokens, torch.full_like(tokens, head.config.mask_token_id))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_one_forward_drafts_every_depth(tiny_llama_dir):
    """With the depth planned, the mask slots of depths 1..3 run in one forward and give the logits they give
    one forward per depth; a decode makes two draft forwards per round (the commit, then the slots)."""
    head, target, _ = _head(tiny_llama_dir)
    draft = head_draft(head.eval(), "peagle")
    sequence = torch.randint(3, target.config.vocab_size, (17,), generator=torch.Generator().manual_seed(1))
    calls = []
    step = head.step
    head.step = lambda *args, **kwargs: calls.append(args[1].shape) or step(*args, **kwargs)
    with torch.inference_mode():
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i][0] for i in draft.feature_layers], dim=-1)
        by_depth = []
        for depth, forwards in ((1, 3), (4, 1)):  # planned 1 deep: a forward per depth asked for; 4 deep: one
            draft.plan_depth(depth)
            draft.start(sequence[:16], int(sequence[16]), features[:16])
            calls.clear()
            # two nodes per depth (ids 2d-2, 2d-1), each the child of one node a depth above
            parents = [[-1, -1], [0, 1], [2, 3]]
            by_depth.append(torch.stack([draft.expand(parents[d - 1], [5, 9])[1] for d in range(1, 4)]))
            assert len(calls) == forwards and calls[-1][1] == 3 // forwards, calls
    torch.testing.assert_close(by_depth[1], by_depth[0], atol=1e-5, rtol=1e-5)
    # a decode: one draft forward at the start, then per round the slots and (between rounds) the commit
    calls.clear()
    prompt = sequence[:9]
    result = SpeculativeDecoder(target, draft, parse_shape("chain:4"), GREEDY, stop_token_ids(target)).generate(prompt, 20)
    assert len(calls) == 2 * len(result.accepted), (len(calls), len(result.accepted))


def test_greedy_with_peagle_equals_target_greedy_alone_and_batched(tmp_path, tiny_qwen2_dir):
    head, target, tokenizer = _head(tiny_qwen2_dir)
    draft = load_head_draft(save_draft(tmp_path / "ckpt", head, {"step": 0}), target, tokenizer,
                            target_path=str(tiny_qwen2_dir))
    eos = stop_token_ids(target)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=generator) for n in (5, 23)]
    references = [target_generate(target, p, 24, GREEDY, eos) for p in prompts]
    for prompt, reference in zip(prompts, references):
        for spec in ("chain:3", "dynamic:depth=3,topk=2,nodes=6"):
            assert SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate(prompt, 24).tokens == reference
    batched = BatchedDecoder(target, draft, parse_shape("chain:3"), GREEDY, eos).generate([p.tolist() for p in prompts], 24)
    assert [r.tokens for r in batched] == references


def test_training_moves_the_mask_feature(tiny_llama_dir):
    head, target, _ = _head(tiny_llama_dir)
    sequence = torch.randint(3, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    batch = target_batch(target, sequence, head.config.aux_layers)
    out = unroll(head, batch, Teacher(target.get_output_embeddings().weight, None, 64), 3, parse_loss_mix("forward_kl"))
    sum(out.loss_sums[1:]).backward()  # only the mask steps read mask_hidden
    assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0


def test_vllm_export(tmp_path, tiny_llama_dir):
    """EAGLE-3's vLLM layout as the `peagle` speculators type, with mask_token_id and mask_hidden [1, 3H];
    served with parallel drafting; reading it back gives the head's logits. SGLang has no such model."""
    head, target, _ = _head(tiny_llama_dir)
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0, "target_path": str(tiny_llama_dir)})
    out = export_draft(checkpoint, "vllm", tmp_path / "vllm", dtype="float32", speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == head.config.mask_token_id
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("mask_hidden").shape == (1, 3 * head.config.hidden_size)
    assert '"parallel_drafting": true' in serve_command("vllm", "peagle", "TARGET", out, 3)
    back = load_exported(out, target.get_input_embeddings().weight)
    torch.testing.assert_close(back.mask_hidden, head.mask_hidden.detach())
    with pytest.raises(Exception, match="sglang|format"):
        export_draft(checkpoint, "sglang", tmp_path / "sglang", dtype="float32")
