"""`eyas eval`: table, JSON and plot for several configurations in one call; prompt sources; bad input."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.eval.cli import main
from eyas.eval.decoder import DecodeResult
from eyas.eval.metrics import BaselineTally, Tally, summarize
from eyas.eval.prompts import prompt_from_row

torch.set_num_threads(1)


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post about Hawaii.", "Rewrite it."]},
    {"question_id": 82, "category": "writing", "turns": ["Draft a short email to a colleague."]},
    {"question_id": 121, "category": "coding", "turns": ["def add(a, b):"]},
    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "What is the capital of France?"}], "category": "qa"},
    {"unrelated": True},
]


def run_cli(args, capsys):
    """Run `eyas eval`; err keeps only eyas' own lines (not transformers' weight-loading bar)."""
    code = main([str(a) for a in args] + ["--no-progress"])
    out, err = capsys.readouterr()
    err = "".join(line + "\n" for line in err.replace("\r", "\n").splitlines() if line.startswith("eyas"))
    return code, out, err


def test_several_drafts_and_shapes_in_one_table_json_and_plot(tmp_path, tiny_llama_dir, capsys):
    prompts = write_prompts(tmp_path / "mt.jsonl", MT_BENCH)
    out_dir = tmp_path / "out"
    code, out, err = run_cli(["--target", tiny_llama_dir, "--draft", "truncated:2", "--draft", "truncated:6",
                              "--prompts", prompts, "--shapes", "chain:3", "dynamic:depth=3,topk=2,nodes=6",
                              "--max-new-tokens", 12, "--out", out_dir], capsys)
    assert code == 0, err
    report = json.loads((out_dir / "report.json").read_text())
    assert [c["label"] for c in report["configs"]] == [
        "truncated:2 chain:3", "truncated:2 dynamic:depth=3,topk=2,nodes=6",
        "truncated:6 chain:3", "truncated:6 dynamic:depth=3,topk=2,nodes=6"]
    assert report["settings"]["prompts_used"] == 5  # 4 conversations, question 81 with its second turn
    assert report["settings"]["skipped"] == {"no user prompt in row": 1}
    for config in report["configs"]:
        s = config["overall"]
        assert len(s["alpha"]) == 3 and len(s["cumulative"]) == 3
        assert s["greedy_match"] == {"matched": 5, "compared": 5}   # T=0: identical to the target
        assert set(config["per_turn"]) == {"1", "2"} and config["per_turn"]["2"]["prompts"] == 1
        assert set(config["per_category"]) == {"writing", "coding", "qa"}
        assert s["speedup"] is not None and s["baseline_tokens_per_s"] > 0
        if config["shape"] == "chain:3":  # for a chain, tau equals the tau predicted from the alphas
            assert s["tau"] == pytest.approx(s["tau_from_alpha"])
            assert s["tau_iid"] is not None
    full_copy = report["configs"][2]["overall"]  # all 6 layers: the target itself accepts everything
    assert full_copy["alpha"] == [1.0, 1.0, 1.0] and full_copy["tau"] > 3.0
    png = (out_dir / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out_dir / "recipe.yaml").is_file()
    assert "truncated:6" in out and "tau" in out and "per category" in out
    # the reference decode of the last prompt shows up in the JSON with the exact settings
    assert report["settings"]["temperature"] == 0.0 and report["recipe"]["eval"]["max_new_tokens"] == 12


def test_sampling_run_and_heldout_prompts_from_a_recipe(tmp_path, tiny_qwen2_dir, capsys):
    from datasets import Dataset

    run_dir = tmp_path / "runs" / "r1"
    conversations = [
        [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "How are you?"},
         {"role": "assistant", "content": "Fine."}],
    ]
    Dataset.from_dict({"id": ["a", "b"], "input_ids": [[1], [2]], "loss_mask": [[0], [1]],
                       "messages": conversations}).save_to_disk(str(run_dir / "prepared" / "heldout"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"run: {{name: r1, output_dir: {tmp_path / 'runs'}}}\ntarget: {{path: {tiny_qwen2_dir}}}\n"
                      "eval: {drafts: ['truncated:3'], shapes: ['chain:2', 'tree:[[0],[1],[0,0]]'], max_new_tokens: 10}\n")
    code, out, err = run_cli([recipe, "eval.temperature=0.8", "eval.top_p=0.9"], capsys)
    assert code == 0, err
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["settings"]["prompts_used"] == 2 and report["settings"]["temperature"] == 0.8
    assert set(report["configs"][0]["per_category"]) == {"heldout"}
    assert all("greedy_match" not in c["overall"] for c in report["configs"])  # only compared at T=0
    assert (run_dir / "eval" / "acceptance.png").is_file()


def test_prompt_rows_are_cut_at_the_last_user_turn():
    row = {"messages": MT_BENCH[3]["messages"] + [{"role": "assistant", "content": "Paris."}]}
    prompt = prompt_from_row(row, 0)
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
    assert prompt_from_row(MT_BENCH[0], 0).messages == [{"role": "user", "content": MT_BENCH[0]["turns"][0]}]
    assert prompt_from_row({"messages": [{"role": "assistant", "content": "x"}]}, 0) is None


def test_over_long_prompts_are_skipped_and_counted(tmp_path, tiny_llama_dir, capsys):
    long_text = "The quick brown fox jumps over the lazy dog. " * 60  # far past the tiny target's 512 positions
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "Hello there"}, {"prompt": long_text}])
    code, _, err = run_cli(["--target", tiny_llama_dir, "--draft", "truncated:2", "--prompts", prompts,
                            "--shapes", "chain:2", "--max-new-tokens", 8, "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    skipped = json.loads((tmp_path / "o" / "report.json").read_text())["settings"]["skipped"]
    assert list(skipped.values()) == [1] and "longer than the context" in next(iter(skipped))
    only_long = write_prompts(tmp_path / "q.jsonl", [{"prompt": long_text}])
    code, _, err = run_cli(["--target", tiny_llama_dir, "--draft", "truncated:2", "--prompts", only_long,
                            "--shapes", "chain:2", "--out", tmp_path / "o2"], capsys)
    assert code == 2 and "longer than the target's context" in err


@pytest.mark.parametrize("extra,message", [
    (["--shapes", "star:3"], "unknown draft shape 'star:3'"),
    (["--shapes", "tree:[[0],[2]]"], "needs its elder sibling [1]"),
    (["--shapes", "tree:[[0,0]]"], "has no parent [0]"),
    (["--shapes", "dynamic:depth=3,topk=2"], "missing nodes"),
    (["--temperature", "-1"], "'eval.temperature' must be >= 0"),
    (["--temperature", "hot"], "'eval.temperature' must be float"),
    (["--top-p", "0"], "'eval.top_p' must be in (0.0, 1.0]"),
    (["--draft", "truncated:99"], "num_layers must be in 1..6"),
    (["--draft", "/no/such/dir"], "neither an existing directory nor a known draft"),
])
def test_bad_input_is_one_clear_line(tmp_path, tiny_llama_dir, capsys, extra, message):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "Hello"}])
    args = ["--target", tiny_llama_dir, "--prompts", prompts, "--out", tmp_path / "o"]
    if "--draft" not in extra:
        args += ["--draft", "truncated:2"]
    code, _, err = run_cli(args + extra, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("eyas: error: ") and message in err


def test_empty_prompt_file_and_missing_draft(tmp_path, tiny_llama_dir, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run_cli(["--target", tiny_llama_dir, "--draft", "truncated:2", "--prompts", empty], capsys)
    assert code == 2 and "is empty" in err and err.count("\n") == 1
    useless = write_prompts(tmp_path / "u.jsonl", [{"x": 1}, {"turns": []}])
    code, _, err = run_cli(["--target", tiny_llama_dir, "--draft", "truncated:2", "--prompts", useless], capsys)
    assert code == 2 and "has no usable prompts (2 rows" in err
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "Hello"}])
    code, _, err = run_cli(["--target", tiny_llama_dir, "--prompts", prompts, f"run.output_dir={tmp_path}"], capsys)
    assert code == 2 and "no draft to evaluate" in err


def test_summary_numbers_from_known_counts():
    """Two chain:3 rounds accepting 3 and 1 tokens, one accepting 0 -> pinned alpha, cumulative, tau."""
    tally = Tally()
    result = DecodeResult(tokens=list(range(7)), accepted=[3, 1, 0], attempts=[3, 2, 1], accepts=[2, 1, 1],
                          tree_sizes=[3, 3, 3], draft_s=1.0, target_s=2.0, total_s=4.0)
    tally.add(result)
    base = BaselineTally()
    base.add(7, 7.0)
    s = summarize(tally, depth=3, chain=True, baseline=base)
    assert s["alpha"] == [2 / 3, 1 / 2, 1.0]
    assert s["cumulative"] == [2 / 3, 1 / 3, 1 / 3]
    assert s["tau"] == pytest.approx(1 + 4 / 3)
    assert s["tau_from_alpha"] == pytest.approx(1 + 2 / 3 + 1 / 3 + 1 / 3)
    a = 4 / 6
    assert s["tau_iid"] == pytest.approx((1 - a ** 4) / (1 - a))
    assert s["speedup"] == pytest.approx((7 / 4.0) / (7 / 7.0))
    assert s["time"]["bookkeeping_frac"] == pytest.approx(0.25)
    assert s["accepted_histogram"] == [1, 1, 0, 1]


def test_checkpoint_for_another_target_is_refused(tmp_path, tiny_llama_dir, tiny_qwen2_dir, capsys):
    from test_eval_heads import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "qwen_head", tiny_qwen2_dir, "eagle3")
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "Hello"}])
    code, _, err = run_cli(["--target", tiny_llama_dir, "--draft", ckpt, "--prompts", prompts,
                            "--shapes", "chain:2", "--out", tmp_path / "o"], capsys)
    assert code == 2 and "was made for another target: target identity" in err


def test_max_prompts_keeps_every_category(tmp_path):
    from eyas.eval.prompts import load_prompts

    rows = [{"turns": [f"q{i}"], "category": cat} for i, cat in enumerate("aaabbc")]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts, _ = load_prompts(str(path), max_prompts=4)
    assert [(p.category, p.messages[0]["content"]) for p in prompts] == [("a", "q0"), ("b", "q3"), ("c", "q5"), ("a", "q1")]
    assert len(load_prompts(str(path), max_prompts=0)[0]) == 6


def test_second_turn_follows_the_targets_own_greedy_answer(tiny_llama_dir):
    """MT-bench style: turn 2 is asked after the target's greedy answer to turn 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.decode import SamplingParams, stop_token_ids
    from eyas.eval.decoder import target_generate
    from eyas.eval.prompts import render
    from eyas.eval.runner import encode_prompts

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt = prompt_from_row({"id": "c1", "category": "chat", "turns": ["Tell me a story.", "Make it shorter."]}, 0)
    encoded, skipped = encode_prompts([prompt], tokenizer, target, max_new_tokens=8, max_nodes=4, answer_tokens=10)
    assert skipped == {} and [e.turn for e in encoded] == [1, 2]
    eos = stop_token_ids(target, tokenizer)
    answer = target_generate(target, encoded[0].ids, 10, SamplingParams(), eos)
    text = tokenizer.decode([t for t in answer if t not in eos], skip_special_tokens=True).strip()
    second = encoded[1].prompt
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[1]["content"] == text and second.messages[2]["content"] == "Make it shorter."
    assert encoded[1].ids == render(second, tokenizer)
