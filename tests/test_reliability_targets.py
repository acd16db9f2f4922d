"""Issue 15, items 4 and 5: target identity by content, stale temporary files, masked LMs,
custom code in a target folder, SIGTERM during start-up."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.config import load_recipe, save_resolved
from eyas.errors import EyasError
from eyas.recipe_schema import TargetConfig
from eyas.targets import load_target_config, load_tokenizer, target_identity


def _identity(folder: Path) -> str:
    return target_identity(load_target_config(str(folder)), load_tokenizer(TargetConfig(path=str(folder))))


def _rows_file(path: Path, n: int = 24) -> Path:
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {i}"},
                                         {"role": "assistant", "content": f"Sure, {i} is a number."}]}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _recipe(root: Path, target: Path, name: str, *extra: str):
    return load_recipe(None, [f"target.path={target}", f"data.source={_rows_file(root / 'rows.jsonl')}",
                              f"run.output_dir={root}", f"run.name={name}", "data.max_length=96",
                              "data.heldout_fraction=0.0", "dump.shard_tokens=400", "dump.draft_vocab_size=64",
                              "dump.layers=[0, 3, 6]", *extra])


# --- identity by content -----------------------------------------------------------------

def test_a_byte_identical_copy_elsewhere_is_the_same_target(tmp_path, tiny_llama_dir):
    from fixtures import build_tiny_target

    from eyas.data.dump import dump
    from eyas.data.prepare import prepare
    from eyas.data.shard_reader import ShardReader

    copy = shutil.copytree(tiny_llama_dir, tmp_path / "elsewhere" / "target-copy")
    assert _identity(copy) == _identity(tiny_llama_dir)
    other = build_tiny_target(tmp_path / "other", "llama", seed=1)  # same shapes, other weights
    assert _identity(other) != _identity(tiny_llama_dir)
    recipe = _recipe(tmp_path, tiny_llama_dir, "moved")
    prepare(recipe)
    dump(recipe)
    ShardReader(recipe.run_dir / "shards", expect_identity=_identity(copy))  # the copy's run accepts them
    with pytest.raises(EyasError, match="another target or tokenizer"):
        ShardReader(recipe.run_dir / "shards", expect_identity=_identity(other))
    moved = _recipe(tmp_path, copy, "moved")  # dump again through the copy: every shard is kept
    assert dump(moved)["shards"] == json.loads((recipe.run_dir / "shards" / "manifest.json").read_text())["shards"]


def test_weights_fingerprint_reads_little_and_sees_one_changed_tensor(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    from eyas.targets import weights_fingerprint

    copy = shutil.copytree(tiny_llama_dir, tmp_path / "t")
    tensors = load_file(str(copy / "model.safetensors"))
    name = "model.layers.3.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] += 1.0  # one value of one layer: the first bytes of that tensor
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_llama_dir)


# --- temporary files left by a kill --------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rerun_removes_temporary_files_of_killed_writers(tmp_path, tiny_llama_dir):
    from eyas.data.dump import dump
    from eyas.data.prepare import prepare

    recipe = _recipe(tmp_path, tiny_llama_dir, "temps")
    prepare(recipe)
    dump(recipe)
    dead = _dead_pid()
    shards, prepared = recipe.run_dir / "shards", recipe.run_dir / "prepared"
    stale = [shards / f".shard-00000.safetensors.tmp.{dead}", shards / f".manifest.json.tmp.{dead}",
             shards / "heldout" / f".index.safetensors.tmp.{dead}", prepared / f".info.json.tmp.{dead}"]
    live = shards / f".shard-00001.safetensors.tmp.{os.getpid()}"  # a writer that is still running
    for path in stale + [live]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a file")
    prepare(recipe)
    dump(recipe)
    assert [p for p in stale if p.exists()] == []
    assert live.exists()


# --- refusals -------------------------------------------------------------------------------

def test_prepare_refuses_a_masked_lm(tmp_path, tiny_llama_dir):
    from eyas.data.prepare import prepare

    bert = tmp_path / "bert"
    bert.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_llama_dir / name).exists():
            shutil.copy(tiny_llama_dir / name, bert / name)
    (bert / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 384, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}))
    recipe = _recipe(tmp_path, bert, "bert")
    with pytest.raises(EyasError, match=r"holds a 'bert' model, which is not a causal LM"):
        prepare(recipe)
    assert not (recipe.run_dir / "prepared" / "train").exists()


# Families whose layers the exact decoder cannot verify, as transformers names them: Qwen3-Next (linear attention
# between full layers, `layer_types`), Mamba (linear attention alone, no heads), RecurrentGemma (recurrent blocks,
# `layers_block_type`), RWKV (no attention heads, no layer list).
HYBRID = {"qwen3_next": ("Qwen3NextForCausalLM", "'linear_attention'"), "mamba": ("MambaForCausalLM", "'linear_attention'"),
          "recurrent_gemma": ("RecurrentGemmaForCausalLM", "'recurrent'"), "rwkv": ("RwkvForCausalLM", "'recurrent'")}


def _config_only_target(folder: Path, family: str, tokenizer_from: Path) -> Path:
    """A target folder holding a tiny config of `family` and a tokenizer, and no weights: a stage that loaded
    weights would fail on their absence, not on the family."""
    from transformers import AutoConfig

    folder.mkdir()
    AutoConfig.for_model(family, vocab_size=384, hidden_size=64, num_hidden_layers=4,
                         architectures=[HYBRID[family][0]]).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def test_every_stage_refuses_a_linear_attention_or_recurrent_target_by_family_before_its_weights(
        tmp_path, tiny_llama_dir, capsys):
    from eyas.cli.main import main as cli

    def refusal(stage: str, recipe: Path, *extra: str) -> str:
        assert cli([stage, str(recipe), *extra]) == 2
        return capsys.readouterr().err

    # prepare and plan read nothing but the target's folder
    for family, (_, layer) in HYBRID.items():
        target = _config_only_target(tmp_path / family, family, tiny_llama_dir)
        recipe = _recipe(tmp_path, target, family)
        recipe_file = save_resolved(recipe, tmp_path / "recipes", f"{family}.yaml")
        for stage in ("prepare", "plan"):
            err = refusal(stage, recipe_file)
            assert f"is a '{family}' model" in err and f"layers are {layer}" in err and "Llama" in err, (stage, err)
        assert not (recipe.run_dir / "prepared" / "train").exists()
    # the later stages, on a run prepared with a supported target whose recipe then names the hybrid one
    prepared = _recipe(tmp_path, tiny_llama_dir, "switched", "data.heldout_fraction=0.25")
    from eyas.data.prepare import prepare

    prepare(prepared)
    switched = _recipe(tmp_path, tmp_path / "qwen3_next", "switched", "data.heldout_fraction=0.25")
    switched = save_resolved(switched, tmp_path / "recipes", "switched.yaml")
    for stage, extra in (("dump", ()), ("train", ()), ("eval", ("--draft", "truncated:1"))):
        err = refusal(stage, switched, *extra)
        assert "is a 'qwen3_next' model, 3 of whose 4 layers are 'linear_attention'" in err, (stage, err)


CUSTOM_CONFIG = '''
import os
from pathlib import Path

from transformers import LlamaConfig

Path(os.environ["EYAS_TEST_MARKER"]).write_text("the target's own code ran")


class CustomConfig(LlamaConfig):
    model_type = "eyas_custom_llama"
'''


@pytest.fixture()
def custom_code_target(tmp_path, tiny_llama_dir, monkeypatch):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "custom")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="eyas_custom_llama", auto_map={"AutoConfig": "custom_config.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom_config.py").write_text(CUSTOM_CONFIG)
    marker = tmp_path / "marker"
    monkeypatch.setenv("EYAS_TEST_MARKER", str(marker))

    def no_prompt(*_args, **_kwargs):
        raise AssertionError("asked an interactive question")

    monkeypatch.setattr(builtins, "input", no_prompt)
    return folder, marker


def test_custom_code_is_refused_without_a_prompt_unless_trusted(tmp_path, custom_code_target):
    from eyas.data.prepare import prepare

    folder, marker = custom_code_target
    with pytest.raises(EyasError) as caught:
        load_target_config(str(folder))
    message = str(caught.value)
    assert "custom Python code" in message and "target.trust_remote_code: true" in message
    assert "custom_config.CustomConfig" in message and "\n" not in message
    with pytest.raises(EyasError, match="trust_remote_code"):
        prepare(_recipe(tmp_path, folder, "custom"))
    assert not marker.exists()  # nothing of the folder's code ran
    config = load_target_config(str(folder), trust_remote_code=True)
    assert type(config).__name__ == "CustomConfig" and marker.exists()


def test_recipe_key_trust_remote_code():
    assert TargetConfig().trust_remote_code is False
    assert load_recipe(None, ["target.trust_remote_code=true"]).target.trust_remote_code is True
    with pytest.raises(EyasError, match="target.trust_remote_code' must be bool"):
        load_recipe(None, ["target.trust_remote_code=yes"])


# --- SIGTERM during start-up ------------------------------------------------------------------

def test_sigterm_during_startup_is_one_line(tmp_path, tiny_llama_dir):
    """`eyas prepare` blocks reading a FIFO as its data source: SIGTERM arrives in start-up."""
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{path: {tiny_llama_dir}}}\ndata: {{source: {fifo}}}\n"
                      f"run: {{output_dir: {tmp_path}/runs}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "eyas.cli", "prepare", str(recipe)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    writer, deadline = None, time.monotonic() + 120
    try:
        while writer is None and proc.poll() is None and time.monotonic() < deadline:
            try:  # succeeds once prepare has opened the FIFO to read its rows
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
        assert writer is not None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    lines = [line for line in err.strip().splitlines() if line.startswith("eyas:")]
    assert lines == ["eyas: stopped by SIGTERM before the stage finished; finished files are kept "
                     "(every write is atomic), run the same command again to continue"]
    assert "Traceback" not in err
