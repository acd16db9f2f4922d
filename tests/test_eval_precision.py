"""The eval's target precision (`eval.target_dtype`) and greedy exactness in it.

- `eval_dtype` picks bf16 only where the machine runs it natively (else fp32), keeps an explicit
  target.dtype, and obeys fp32 / bf16.
- In bf16 the speculative decoder's output is the bf16 target's own greedy decode (tiny Llama
  and Qwen2 targets, chain / static tree / dynamic tree, a draft that accepts everything and one
  that is often rejected), compared with the same target in the same precision as the eval's
  `=greedy` column compares it. Where the two part, it is at a near-tie: the two tokens' logits
  within two bf16 rounding steps of each other (a verify over n tokens sums the attention over
  n - 1 more masked positions than a single step does, so a last bit can differ; bf16 rounds
  it into a different token now and then). At least two outputs in three must match throughout
  (`pytest -s` prints how many did).
- A recipe's eval runs and reports in the precision it picked, in the JSON and the table title.
"""

from __future__ import annotations

import json

import pytest
import torch

from eyas import precision
from eyas.decode import SamplingParams, stop_token_ids
from eyas.eval.decoder import SpeculativeDecoder, target_decode
from eyas.eval.drafts import LMDraft, truncated_target
from eyas.eval.tree import parse_shape

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
SHAPES = ["chain:4", "tree:[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]", "dynamic:depth=4,topk=3,nodes=12"]


@pytest.mark.parametrize("native,target_dtype,setting,expected", [
    (False, "auto", "auto", "float32"),      # a CPU without AMX / AVX512-BF16: fp32 is the faster
    (True, "auto", "auto", "bfloat16"),      # native bf16 (AMX, AVX512-BF16, an Ampere+ GPU)
    (True, "float16", "auto", "float16"),    # a target.dtype the recipe sets is kept
    (True, "auto", "fp32", "float32"),       # fp32 for comparisons with earlier reports
    (False, "auto", "bf16", "bfloat16"),     # forced, with a warning line
])
def test_eval_dtype_is_the_native_fast_one_unless_set(monkeypatch, capsys, native, target_dtype, setting, expected):
    monkeypatch.setattr(precision, "native_bf16", lambda device=None: native)
    monkeypatch.setattr(precision, "_warned", set())
    monkeypatch.setattr(precision, "bf16_ratio", lambda: 3.0)
    assert precision.eval_dtype(setting, target_dtype, "cpu") == expected
    warning = capsys.readouterr().err
    assert ("eval.target_dtype: bf16 on a CPU without native bf16" in warning) == (setting == "bf16" and not native)


def load(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_speculative_output_equals_the_bf16_targets_greedy_decode(family, tiny_llama_dir, tiny_qwen2_dir):
    target = load(tiny_llama_dir if family == "llama" else tiny_qwen2_dir, torch.bfloat16)
    eos = stop_token_ids(target)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=generator).tolist() for n in (3, 20, 41, 77)]
    references = [target_decode(target, p, 40, GREEDY, eos) for p in prompts]
    drafts = [LMDraft(truncated_target(target, target.config.num_hidden_layers), "copy"),
              LMDraft(truncated_target(target, 2), "truncated:2")]
    accepted, equal, compared = {}, 0, 0
    for draft in drafts:
        for spec in SHAPES:
            decoder = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos)
            rounds = []
            for prompt, reference in zip(prompts, references):
                result = decoder.generate(prompt, 40)
                rounds += result.accepted
                compared += 1
                if result.tokens == reference:
                    equal += 1
                    continue
                at = next(i for i, (a, b) in enumerate(zip(result.tokens, reference)) if a != b)
                assert near_tie(target, prompt + reference[:at], result.tokens[at], reference[at]), \
                    f"{family} bf16 {draft.name} {spec} prompt of {len(prompt)}: parts from the target at token {at}"
            accepted[(draft.name, spec)] = sum(rounds) / len(rounds)
    print(f"{family} bf16: {equal} of {compared} speculative outputs equal to the bf16 target's greedy decode")
    assert equal * 3 >= compared * 2, f"only {equal} of {compared} bf16 outputs equal to the bf16 target's"
    for spec in SHAPES:  # multi-token verifies really ran: the copy accepts deep paths
        assert accepted[("copy", spec)] >= 2.5


@torch.inference_mode()
def near_tie(target, context: list[int], token_a: int, token_b: int) -> bool:
    """Whether the target's logits for the two tokens after `context` lie within two bf16 rounding steps."""
    logits = target(input_ids=torch.tensor([context])).logits[0, -1].float()
    step = 2.0 ** (torch.floor(torch.log2(logits.max().abs())) - 7)  # bf16: 8 significant bits
    return abs(float(logits[token_a] - logits[token_b])) <= 2 * float(step)


def test_eval_runs_and_reports_the_precision_it_picked(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    from eyas.eval.cli import main

    monkeypatch.setattr(precision, "native_bf16", lambda device=None: False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there, how are you?"}) + "\n" +
                       json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"run: {{name: r1, output_dir: {tmp_path / 'runs'}}}\ntarget: {{path: {tiny_llama_dir}}}\n"
                      f"eval: {{drafts: ['truncated:2'], shapes: ['chain:3'], max_new_tokens: 12, prompts: {prompts}}}\n")
    for setting, dtype in (("auto", "float32"), ("bf16", "bfloat16")):
        out = tmp_path / setting
        assert main([str(recipe), f"eval.target_dtype={setting}", f"eval.output={out}", "--no-progress"]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["target"]["dtype"] == dtype and report["target"]["dtype_setting"] == setting
        assert report["configs"][0]["overall"]["greedy_match"] == {"matched": 2, "compared": 2}
        assert f"({dtype}): T=0" in capsys.readouterr().out
