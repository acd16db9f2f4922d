"""At T > 0 the whole decoder keeps the target's distribution on mixture-of-experts and sliding-window
targets: end to end, through their own forwards, caches and the tree masks of sliding layers.

tests/test_eval_exact.py checks the verifier on looked-up logits; here `SpeculativeDecoder.generate`
runs for real on a tiny Qwen3-MoE and a tiny gpt-oss (alternating 8-token sliding-window and full
layers, attention sinks, 4 experts) over 16 token ids, with a 12-token context so every draft and
verify position lies past the window. The first two tokens of SAMPLES decodes are tallied; their
empirical joint must be as close to the exact joint (the target's own softmax, two forwards deep) as
the same number of direct samples from that joint are (no further than the largest of 1,000 such
samplings: test_eval_exact.tv_noise). A decoder that accepts every drafted token fails the same check
(the test has the power to see it), even on a quarter of the decodes (its bias stays, the noise floor
only doubles).
"""

from __future__ import annotations

import pytest
import torch
from fixtures import _tiny_config
from test_eval_exact import tv_noise

from eyas.decode import SamplingParams, process_logits
from eyas.eval import decoder as decoder_mod
from eyas.eval.decoder import SpeculativeDecoder
from eyas.eval.drafts import LMDraft, truncated_target
from eyas.eval.verify import sample
from eyas.shapes import parse_shape

torch.set_num_threads(1)
VOCAB = 16
SAMPLES = 1000
CONTEXT = [3, 7, 1, 12, 5, 9, 14, 4, 11, 6, 13, 8]  # 12 tokens: past the 8-token window
PARAMS = SamplingParams(temperature=1.0)


def _target(family: str):
    from transformers import AutoModelForCausalLM

    config = _tiny_config(family, VOCAB)
    config.eos_token_id = None  # no stop: every decode gives its two tokens
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked, but with room for the draft to be wrong
    return model


def _exact_joint(target) -> torch.Tensor:
    """P(t1, t2 | CONTEXT) under the target at PARAMS: [VOCAB, VOCAB]."""
    with torch.inference_mode():
        first = process_logits(target(torch.tensor([CONTEXT])).logits[0, -1].float(), PARAMS)
        ids = torch.tensor([CONTEXT + [a] for a in range(VOCAB)])
        second = torch.stack([process_logits(row, PARAMS) for row in target(ids).logits[:, -1].float()])
    return first[:, None] * second


def _decoded_tv(target, draft, shape: str, joint: torch.Tensor, samples: int = SAMPLES) -> float:
    decoder = SpeculativeDecoder(target, draft, parse_shape(shape), PARAMS, [], seed=0)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(samples):
        a, b = decoder.generate(CONTEXT, 2).tokens[:2]
        counts[a, b] += 1
    return 0.5 * float((counts / samples - joint).abs().sum())


def _case(family: str):
    target = _target(family)
    return target, _exact_joint(target), LMDraft(truncated_target(target, 1), "truncated:1")


@pytest.mark.parametrize("family, shape", [("qwen3_moe", "chain:3"), ("gpt_oss", "dynamic:depth=3,topk=2,nodes=5")])
def test_sampled_decodes_follow_the_targets_joint(family, shape):
    target, joint, draft = _case(family)
    floor, bound = tv_noise(joint, SAMPLES)
    tv = _decoded_tv(target, draft, shape, joint)
    print(f"{family} {shape}: TV {tv:.4f}, {tv / floor:.2f} x the floor {floor:.4f} (bound {bound:.4f})")
    assert tv <= bound, f"{family} {shape}: TV {tv:.4f} > {bound:.4f}, the largest of 1,000 plain samplings"


def _accept_drafted_path(children, tokens, target_probs, child_q, generator):
    """A wrong verifier: the first drafted path kept whole (the draft's distribution, not the target's)."""
    path, node = [], 0
    while children[node]:
        node = children[node][0]
        path.append(node)
    return path, sample(target_probs[node], generator)


def test_a_decoder_that_keeps_every_draft_token_fails_the_check(monkeypatch):
    target, joint, draft = _case("gpt_oss")
    samples = SAMPLES // 4
    floor, bound = tv_noise(joint, samples)
    monkeypatch.setattr(decoder_mod, "verify_sampled", _accept_drafted_path)
    tv = _decoded_tv(target, draft, "chain:3", joint, samples)
    print(f"accepting every drafted token: TV {tv:.4f}, {tv / floor:.2f} x the floor {floor:.4f}")
    assert tv > bound, f"a biased decoder passed (TV {tv:.4f}, bound {bound:.4f})"
