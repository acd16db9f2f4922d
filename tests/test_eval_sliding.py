"""Greedy losslessness on targets with sliding-window layers, past the window.

Three tiny targets with a window of 8 tokens: gpt-oss-shaped (sliding and full layers alternating,
attention sinks, a mixture of experts; eager attention), Mistral-shaped (every layer sliding, no
`layer_types`) and Qwen2 with `use_sliding_window` (full layers below, sliding above). Prompts and
generations run well past the window; every speculative output must equal transformers' own greedy
`generate`, which keeps sliding caches of its own. The test has the power to see a decoder that
ignores the window: with the sliding layers masked as full ones, some output differs.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import build_tiny_target

from eyas.decode import SamplingParams, stop_token_ids
from eyas.errors import EyasError
from eyas.eval import kv
from eyas.eval.batched import BatchedDecoder, batch_unsupported
from eyas.eval.decoder import SpeculativeDecoder, target_decode, target_generate
from eyas.eval.drafts import LMDraft, truncated_target
from eyas.eval.prompts import Prompt
from eyas.eval.runner import EncodedPrompt, evaluate
from eyas.shapes import parse_shape

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
SHAPES = ["chain:4", "tree:[[0],[1],[0,0],[0,1],[0,0,0]]", "dynamic:depth=4,topk=3,nodes=10"]
LENGTHS = [(5, 30), (20, 24), (12, 40)]  # (prompt tokens, new tokens): every decode passes the 8-token window
FAMILIES = {"gpt_oss": {}, "mistral": {},
            "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_target(tmp_path_factory.mktemp(request.param), request.param, **FAMILIES[request.param])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert kv.SLIDING in kv.attention_kinds(model.config) and model.config.sliding_window == 8
    return model


def _cases(target) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(3, target.config.vocab_size, (n,), generator=generator).tolist(), new) for n, new in LENGTHS]


def _decode_all(target, cases, shapes=SHAPES, truncated: bool = True) -> list[list[int]]:
    """Every case decoded with the full-depth copy of the target as its draft (accepted almost always, so the
    verify trees run deep past the window), then with a one-layer truncation (rejected often), in each shape."""
    eos = stop_token_ids(target)
    drafts = [LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy")]
    drafts += [LMDraft(truncated_target(target, 1), "truncated:1")] if truncated else []
    outputs = []
    for draft in drafts:
        for spec in shapes:
            decoder = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos)
            outputs += [decoder.generate(prompt, new).tokens for prompt, new in cases]
    return outputs


def test_greedy_output_equals_the_targets_own_past_the_window(target, monkeypatch):
    eos = stop_token_ids(target)
    cases = _cases(target)
    references = [target_generate(target, prompt, new, GREEDY, eos) for prompt, new in cases]
    assert [target_decode(target, prompt, new, GREEDY, eos) for prompt, new in cases] == references  # the baseline
    assert _decode_all(target, cases) == references * (2 * len(SHAPES))
    # the power to see a decoder blind to the window: masking the sliding layers as full ones changes an output
    monkeypatch.setattr(kv, "attention_kinds", lambda config: [kv.FULL] * config.num_hidden_layers)
    assert _decode_all(target, cases, SHAPES[:1], truncated=False) != references


def _batched_all(target, prompts: list[list[int]], new: int,
                 shapes=("chain:4", "chain:1", "dynamic:depth=3,topk=2,nodes=5")) -> list[list[int]]:
    """The prompts decoded as one batch (ragged rows), with the copy and the one-layer drafts, in each shape (a
    dynamic tree's nodes at their root's position + depth, in every row's own positions)."""
    eos = stop_token_ids(target)
    outputs = []
    for draft in (LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy"),
                  LMDraft(truncated_target(target, 1), "truncated:1")):
        for spec in shapes:
            decoder = BatchedDecoder(target, draft, parse_shape(spec), GREEDY, eos)
            outputs += [result.tokens for result in decoder.generate(prompts, new)]
    return outputs


def test_batched_rows_equal_the_targets_own_past_the_window_and_unknown_layer_kinds_are_refused(target, monkeypatch):
    """Rows of 5, 20 and 12 prompt tokens in one batch, 40 new tokens each: every row's output is the target's own
    greedy decode; with the sliding layers masked as full ones, an output differs."""
    eos = stop_token_ids(target)
    prompts, new = [prompt for prompt, _ in _cases(target)], 40
    references = [target_generate(target, prompt, new, GREEDY, eos) for prompt in prompts]
    draft = LMDraft(truncated_target(target, 1), "truncated:1")
    assert batch_unsupported(draft) is None
    assert _batched_all(target, prompts, new) == references * 6
    items = [EncodedPrompt(Prompt(f"p{i}", "any", []), ids) for i, ids in enumerate(prompts[:2])]
    report = evaluate(target, None, [draft], [parse_shape("chain:3")], items, GREEDY, 16, progress=False, batch_size=2)
    config = report["configs"][0]
    assert config["overall"]["greedy_match"] == {"matched": 2, "compared": 2} and not config.get("batch_note"), config
    with monkeypatch.context() as blind:
        blind.setattr(kv, "attention_kinds", lambda config: [kv.FULL] * config.num_hidden_layers)
        assert _batched_all(target, prompts, new, shapes=("chain:4",)) != references * 2
    monkeypatch.setattr(target.config, "layer_types", ["linear_attention"] * target.config.num_hidden_layers,
                        raising=False)
    with pytest.raises(EyasError, match="6 of whose 6 layers are 'linear_attention'; eyas verifies drafts with full and sliding"):
        kv.check_attention(target)
