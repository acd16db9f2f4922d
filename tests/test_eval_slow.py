"""Slow: greedy losslessness on the real SmolLM2 target with truncated-target drafts."""

from __future__ import annotations

import pytest
import torch

from eyas.decode import SamplingParams, stop_token_ids
from eyas.eval.decoder import SpeculativeDecoder, target_generate
from eyas.eval.drafts import LMDraft, truncated_target
from eyas.shapes import parse_shape

GREEDY = SamplingParams(0.0)
PROMPTS = ["Write a haiku about autumn leaves.", "How do I reverse a list in Python?",
           "Tell me one fact about the moon."]


@pytest.mark.slow
def test_smollm2_greedy_speculative_equals_generate(smollm2_dir):
    from eyas.recipe_schema import TargetConfig
    from eyas.targets import load_target

    torch.set_num_threads(1)
    target, tokenizer = load_target(TargetConfig(path=str(smollm2_dir)))
    eos = stop_token_ids(target, tokenizer)
    # 24 of 30 layers agrees often (long accepted paths, pruning); 4 layers rarely (rejections)
    setups = [(LMDraft(truncated_target(target, 24), "truncated:24"), "chain:3"),
              (LMDraft(truncated_target(target, 24), "truncated:24"), "tree:[[0],[1],[0,0],[1,0],[0,0,0]]"),
              (LMDraft(truncated_target(target, 4), "truncated:4"), "dynamic:depth=4,topk=4,nodes=10")]
    accepted = 0
    for text in PROMPTS:
        ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False)["input_ids"]
        reference = target_generate(target, ids, 24, GREEDY, eos)
        for draft, spec in setups:
            result = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate(ids, 24)
            assert result.tokens == reference, f"{draft.name} {spec}: {text}"
            accepted += sum(result.accepted)
    assert accepted > 20  # paths were accepted, so the caches were pruned to them many times
