"""The eval's target precision (`eval.target_dtype`) and greedy exactness in it.

- `auto` picks bf16 only where the machine measured it exact (T=0) and faster (else fp32, its
  baseline timed in the fastest precision), keeps an explicit target.dtype, and obeys fp32 / bf16.
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
from eyas.shapes import parse_shape

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
SHAPES = ["chain:4", "tree:[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]", "dynamic:depth=4,topk=3,nodes=12"]


def _probe(bf16_speed: float, bf16_near_ties: int, fp32_speed: float = 10.0) -> dict:
    """A faked measurement (eval.target_precision.measured) of a machine."""
    def one(speed, near_ties, dtype):
        return {"tokens_per_s": speed, "positions": 282, "mismatches": 0, "near_ties": near_ties,
                "max_logit_diff": 0.06 if near_ties else 0.0, "exact": near_ties == 0, "dtype": dtype}
    return {"float32": one(fp32_speed, 0, "float32"), "bfloat16": one(bf16_speed, bf16_near_ties, "bfloat16")}


@pytest.mark.parametrize("native,probe,temperature,expected,baseline", [
    (False, None, 0.0, "float32", "float32"),              # emulated bf16 (AVX2): not even measured
    (True, _probe(15.0, 0), 0.0, "bfloat16", "bfloat16"),   # exact and faster (an AMX CPU, a GPU): bf16
    (True, _probe(15.0, 3), 0.0, "float32", "bfloat16"),    # faster, not exact: fp32, timed against bf16
    (True, _probe(15.0, 3), 0.7, "bfloat16", "bfloat16"),   # T > 0 samples: exactness is not asked
    (True, _probe(8.0, 0), 0.0, "float32", "float32"),      # exact but slower: fp32
    (True, _probe(10.3, 0), 0.0, "float32", "bfloat16"),    # within the timing noise (AVX512-BF16 on SmolLM2): fp32
])
def test_auto_picks_bf16_only_where_measured_exact_and_faster(monkeypatch, native, probe, temperature, expected,
                                                              baseline):
    from eyas.eval import target_precision
    from eyas.recipe_schema import TargetConfig

    monkeypatch.setattr(target_precision, "native_bf16", lambda device=None: native)

    def measured(target, device):
        assert native, "bf16 measured on a machine without native bf16"
        return probe
    monkeypatch.setattr(target_precision, "measured", measured)
    chosen = target_precision.choose(TargetConfig(path="x"), "auto", temperature)
    assert (chosen.dtype, chosen.baseline_dtype) == (expected, baseline)
    assert chosen.reason.startswith(expected) and chosen.probe is probe


@pytest.mark.parametrize("native,target_dtype,setting,expected", [
    (True, "float16", "auto", "float16"),    # a target.dtype the recipe sets is kept
    (True, "auto", "fp32", "float32"),       # fp32 for comparisons with earlier reports
    (False, "auto", "bf16", "bfloat16"),     # forced, with a warning line
])
def test_a_set_precision_is_obeyed_unmeasured(monkeypatch, capsys, native, target_dtype, setting, expected):
    from eyas.eval import target_precision
    from eyas.recipe_schema import TargetConfig

    monkeypatch.setattr(precision, "native_bf16", lambda device=None: native)
    monkeypatch.setattr(precision, "_warned", set())
    monkeypatch.setattr(precision, "bf16_ratio", lambda: 3.0)
    monkeypatch.setattr(target_precision, "measured", lambda target, device: pytest.fail("measured a set precision"))
    chosen = target_precision.choose(TargetConfig(path="x", dtype=target_dtype), setting, 0.0)
    assert (chosen.dtype, chosen.baseline_dtype, chosen.probe) == (expected, expected, None)
    warning = capsys.readouterr().err
    assert ("eval.target_dtype: bf16 on a CPU without native bf16" in warning) == (setting == "bf16" and not native)


def test_the_probe_measures_once_per_machine_and_target(tmp_path, tiny_llama_dir, monkeypatch):
    """The real probe on a tiny target: fp32 verifies equal its 1-token decode at every position; the figures
    are cached, so a second eval on the same machine and target measures nothing."""
    from eyas.eval import target_precision
    from eyas.recipe_schema import TargetConfig

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    calls = []
    real = target_precision.probe_dtype
    monkeypatch.setattr(target_precision, "probe_dtype", lambda *a: calls.append(a[0].dtype) or real(*a))
    first = target_precision.measured(TargetConfig(path=str(tiny_llama_dir)), torch.device("cpu"))
    assert calls == [torch.float32, torch.bfloat16]
    fp32 = first["float32"]
    assert fp32["exact"] and fp32["mismatches"] == 0 and fp32["positions"] > 100 and fp32["tokens_per_s"] > 0
    assert first["bfloat16"]["positions"] == fp32["positions"] or first["bfloat16"]["positions"] > 100
    again = target_precision.measured(TargetConfig(path=str(tiny_llama_dir)), torch.device("cpu"))
    assert again == first and len(calls) == 2
    assert len(list((tmp_path / "cache" / "precision").glob("*.json"))) == 1


def test_the_probe_compares_each_verify_row_with_its_own_step(tiny_llama_dir, monkeypatch):
    """Row i of the chunked verify is the logits that chose decoded[i + 1], as step i + 1 was: in fp32 the two
    agree to rounding and choose alike. A verify whose logits differ by D makes every position whose top two
    step logits lie within 2D a near-tie (inexact, though no token flipped); a verify equal to the steps
    bit for bit is exact."""
    from eyas.eval import target_precision

    target = load(tiny_llama_dir, torch.float32)
    decoded, steps = target_precision.decode_steps(target, [5, 6, 7, 8], 24, set())
    verified = target_precision.verify_logits(target, [5, 6, 7, 8], decoded)
    assert len(decoded) == 24 and verified.shape == (23, target.config.vocab_size)
    assert verified.argmax(-1).tolist() == decoded[1:]
    assert float((verified - steps[1:]).abs().max()) < 1e-4

    gaps = steps[1:].topk(2, dim=-1).values
    gaps = gaps[:, 0] - gaps[:, 1]
    shift = float(gaps.median())  # half the positions lie within 2 x (shift / 2) of a tie
    monkeypatch.setattr(target_precision, "PROBE_TEXTS", ("Hello there",))
    monkeypatch.setattr(target_precision, "verify_logits",
                        lambda t, p, d: target_precision.decode_steps(t, p, len(d), set())[1][1:len(d)] + shift / 2 *
                        (torch.arange(target.config.vocab_size) % 2))
    noisy = target_precision.probe_dtype(target, load_tokenizer_of(tiny_llama_dir))
    assert noisy["near_ties"] > 0 and not noisy["exact"] and noisy["max_logit_diff"] == pytest.approx(shift / 2)
    monkeypatch.setattr(target_precision, "verify_logits",
                        lambda t, p, d: target_precision.decode_steps(t, p, len(d), set())[1][1:len(d)])
    same = target_precision.probe_dtype(target, load_tokenizer_of(tiny_llama_dir))
    assert same["exact"] and same["near_ties"] == same["mismatches"] == 0 and same["max_logit_diff"] == 0


def load_tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


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
    """The eval decodes in the precision picked, times the target alone in the fastest one measured, compares
    outputs with the target in the decodes' precision, and the table names both."""
    from eyas.eval import target_precision
    from eyas.eval.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there, how are you?"}) + "\n" +
                       json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"run: {{name: r1, output_dir: {tmp_path / 'runs'}}}\ntarget: {{path: {tiny_llama_dir}}}\n"
                      f"eval: {{drafts: ['truncated:2'], shapes: ['chain:3'], max_new_tokens: 12, prompts: {prompts}}}\n")
    monkeypatch.setattr(target_precision, "native_bf16", lambda device=None: True)
    monkeypatch.setattr(target_precision, "measured", lambda target, device: _probe(15.0, 3))  # faster, inexact
    for setting, dtype, baseline in (("auto", "float32", "bfloat16"), ("bf16", "bfloat16", "bfloat16"),
                                     ("fp32", "float32", "float32")):
        out = tmp_path / setting
        assert main([str(recipe), f"eval.target_dtype={setting}", f"eval.output={out}", "--no-progress"]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["target"]["dtype"] == dtype and report["target"]["dtype_setting"] == setting
        assert report["target"]["baseline_dtype"] == report["baseline"]["dtype"] == baseline
        assert report["configs"][0]["overall"]["greedy_match"] == {"matched": 2, "compared": 2}
        shown = capsys.readouterr().out
        assert f"({dtype}): T=0" in shown and f"target alone ({baseline})" in shown


def test_a_bf16_table_says_why_outputs_may_differ():
    from eyas.eval.report import rounding_note

    def report(dtype, matched):
        return {"settings": {"temperature": 0.0}, "target": {"dtype": dtype, "dtype_reason": "bfloat16: set by x"},
                "configs": [{"overall": {"greedy_match": {"matched": matched, "compared": 8}}}]}
    assert rounding_note(report("float32", 4)) is None and rounding_note(report("bfloat16", 8)) is None
    note = rounding_note(report("bfloat16", 4))
    assert "round differently" in note and "eval.target_dtype=fp32 is exact" in note
