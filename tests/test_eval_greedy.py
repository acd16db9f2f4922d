"""Greedy losslessness: the speculative decoder's output equals the target's own greedy decode.

For tiny Llama, Qwen2 and Qwen3-MoE targets, chain / static tree / dynamic tree, three drafts (the full
target copy, which accepts everything and so prunes every side branch; a 2-layer truncation;
an unrelated random model that is almost always rejected), prompts of several lengths and
generation lengths, compared token for token with HF `generate(do_sample=False)`.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import build_tiny_target

from eyas.decode import SamplingParams, stop_token_ids
from eyas.eval.decoder import SpeculativeDecoder, target_generate
from eyas.eval.drafts import LMDraft, truncated_target
from eyas.shapes import parse_shape

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
SHAPES = ["chain:4", "tree:[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]", "dynamic:depth=4,topk=3,nodes=12"]
LENGTHS = [(3, 1), (9, 17), (20, 40), (41, 33)]  # (prompt tokens, new tokens)


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """An unrelated random model with the same vocabulary: a draft the target rejects."""
    return load(build_tiny_target(tmp_path_factory.mktemp("other"), "llama", seed=99))


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n, _ in LENGTHS]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_greedy_output_equals_target_greedy(family, tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_moe_dir, other_model):
    target = load({"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3_moe": tiny_qwen3_moe_dir}[family])
    eos = stop_token_ids(target)
    cases = prompts(target.config.vocab_size)
    references = [target_generate(target, p, new, GREEDY, eos) for p, (_, new) in zip(cases, LENGTHS)]
    drafts = [LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy"),
              LMDraft(truncated_target(target, 2), "truncated:2"),
              LMDraft(other_model, "random")]
    accepted_by = {}
    for draft in drafts:
        for spec in SHAPES:
            decoder = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos)
            accepted = []
            for prompt, (_, new), reference in zip(cases, LENGTHS, references):
                result = decoder.generate(prompt, new)
                assert result.tokens == reference, f"{family} {draft.name} {spec} prompt of {len(prompt)}"
                accepted += result.accepted
            accepted_by[(draft.name, spec)] = sum(accepted) / max(len(accepted), 1)
    # the runs above really exercised acceptance and pruning: the copy accepts deep paths, the
    # random model almost nothing
    for spec in SHAPES:
        assert accepted_by[("copy", spec)] >= 2.5
        assert accepted_by[("random", spec)] < accepted_by[("copy", spec)]


def test_the_timed_baseline_is_the_targets_own_greedy_decode(tiny_llama_dir):
    """`target_decode` (the bare loop the speedup is measured against) equals HF `generate`."""
    from transformers import AutoModelForCausalLM

    from eyas.eval.decoder import target_decode

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    eos = stop_token_ids(target)
    for prompt in ([1, 5, 9, 13], [7] * 30, [3, 100, 42]):
        assert target_decode(target, prompt, 20, GREEDY, eos) == target_generate(target, prompt, 20, GREEDY, eos)
    stop = target_generate(target, [1, 5, 9, 13], 20, GREEDY, eos)[4]  # an EOS id the model does emit
    assert target_decode(target, [1, 5, 9, 13], 20, GREEDY, [stop]) == target_generate(target, [1, 5, 9, 13], 20,
                                                                                      GREEDY, [stop])
