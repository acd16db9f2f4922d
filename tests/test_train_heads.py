"""Draft heads: shapes per kind and family, equality with transformers' own blocks,
the TTT attention against a dense mask, KV-cache decoding, init from the target, save/load."""

from __future__ import annotations

import pytest
import torch
from train_helpers import draft_cfg, synthetic_batch, tiny_d2t, tiny_target_config
from transformers import DynamicCache

from eyas.draft.blocks import DecoderLayer, TTTCache
from eyas.draft.checkpoint import load_draft, save_draft
from eyas.draft.registry import build_head, head_class
from eyas.errors import EyasError

EAGLE3_KEYS = [
    "d2t", "embed_tokens.weight", "fc.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.mlp.down_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.v_proj.weight",
    "norm.weight", "t2d",
]
EAGLE_KEYS = [
    "embed_tokens.weight", "fc.bias", "fc.weight", "layers.0.mlp.down_proj.weight", "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.v_proj.weight",
    "lm_head.weight",
]
MTP_LAYER_KEYS = [
    "eh_proj.weight", "enorm.weight", "hnorm.weight", "input_layernorm.weight", "mlp.down_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "norm.weight", "post_attention_layernorm.weight",
    "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight",
]


def test_state_dict_keys_per_kind():
    tc = tiny_target_config()
    eagle3 = build_head(draft_cfg("eagle3"), tc, d2t=tiny_d2t())
    assert sorted(eagle3.state_dict()) == EAGLE3_KEYS
    assert eagle3.lm_head.weight.shape == (200, 64) and eagle3.fc.weight.shape == (64, 192)
    assert eagle3.midlayer.self_attn.q_proj.weight.shape == (64, 128)  # attention reads concat(embed, feature)
    assert sorted(build_head(draft_cfg("eagle"), tc).state_dict()) == EAGLE_KEYS
    mtp = build_head(draft_cfg("mtp", num_steps=3), tc)
    expected = sorted(["embed_tokens.weight", "lm_head.weight"]
                      + [f"layers.{k}.{n}" for k in range(3) for n in MTP_LAYER_KEYS])
    assert sorted(mtp.state_dict()) == expected


def test_frozen_parts_per_kind():
    tc = tiny_target_config()
    eagle3 = build_head(draft_cfg("eagle3"), tc, d2t=tiny_d2t())
    assert not eagle3.embed_tokens.weight.requires_grad and eagle3.lm_head.weight.requires_grad
    for kind in ("eagle", "mtp"):
        head = build_head(draft_cfg(kind), tc)
        assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
        assert all(p.requires_grad for n, p in head.named_parameters() if not n.startswith(("embed", "lm_head")))


def test_qwen2_biases_and_full_vocab_without_d2t():
    # an mtp layer is shaped as the target's (q/k/v biases); the EAGLE-3 layer is bias-free as the engines build it
    mtp = build_head(draft_cfg("mtp"), tiny_target_config("qwen2")).layers[0].self_attn
    assert mtp.q_proj.bias is not None and mtp.k_proj.bias is not None and mtp.o_proj.bias is None
    head = build_head(draft_cfg("eagle3"), tiny_target_config("qwen2"))
    attn = head.midlayer.self_attn
    assert attn.q_proj.bias is None and attn.k_proj.bias is None and attn.o_proj.bias is None
    assert head.d2t is None and head.lm_head.weight.shape[0] == 384
    assert head.config.aux_layers == [1, 3, 5]  # default_layers(6): distinct, inside 1..5


def test_layer_matches_transformers_llama_layer_with_rope_scaling():
    """Our decoder layer with a Llama layer's weights gives the same output, llama3 RoPE scaling included."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    tc = tiny_target_config(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    tc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = LlamaDecoderLayer(tc, 0)
    head = build_head(draft_cfg("mtp"), tc)
    ours = DecoderLayer(head.config)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(2, 200, 64)
    pos = torch.arange(200).unsqueeze(0).expand(2, -1)
    cos, sin = LlamaRotaryEmbedding(tc)(x, pos)
    ours_cos, ours_sin = head.rotary_emb(x, pos)
    assert torch.equal(cos, ours_cos) and torch.equal(sin, ours_sin)
    expected = reference(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(ours(x, cos, sin, None, None, 0), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_ttt_attention_equals_dense_mask_through_dynamic_cache(kind):
    """TTTCache's attention == the documented 4D mask (context causal + own diagonal) via DynamicCache."""
    torch.manual_seed(0)
    tc = tiny_target_config()
    head = build_head(draft_cfg(kind), tc, d2t=tiny_d2t() if kind == "eagle3" else None)
    batch = synthetic_batch(pad_last=0)
    bsz, seq = batch["input_ids"].shape
    pos = torch.arange(seq).unsqueeze(0).expand(bsz, -1)
    tokens = torch.roll(batch["input_ids"], -1, 1)
    feat_fast = feat_dense = head.project(batch["aux_hidden"] if kind == "eagle3" else batch["last_hidden"])
    tok_fast = tok_dense = tokens
    ttt, dyn = TTTCache(), DynamicCache()
    context = torch.arange(seq)[None, :] <= torch.arange(seq)[:, None]
    for k in range(4):
        mask = torch.cat([context] + [torch.eye(seq, dtype=torch.bool)] * k, dim=1)[None, None]
        h_fast, lg_fast = head.step(k, tok_fast, feat_fast, pos + k, past_key_values=ttt)
        h_dense, lg_dense = head.step(k, tok_dense, feat_dense, pos + k, attention_mask=mask, past_key_values=dyn)
        torch.testing.assert_close(lg_fast, lg_dense, rtol=1e-5, atol=1e-5)
        feat_fast, feat_dense = h_fast, h_dense
        tok_fast = tok_dense = head.draft_to_target(lg_dense.argmax(-1))
    assert dyn.get_seq_length(0) == 4 * seq


def test_incremental_decoding_with_dynamic_cache_equals_full_causal():
    torch.manual_seed(0)
    head = build_head(draft_cfg("eagle3"), tiny_target_config(), d2t=tiny_d2t())
    batch = synthetic_batch(batch=1, pad_last=0)
    ids, feat = batch["input_ids"], head.project(batch["aux_hidden"])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    _, full = head.step(0, ids, feat, pos)
    cache = DynamicCache()
    _, first = head.step(0, ids[:, :10], feat[:, :10], pos[:, :10], past_key_values=cache)
    pieces = [first]
    for t in range(10, ids.shape[1]):
        _, lg = head.step(0, ids[:, t:t + 1], feat[:, t:t + 1], pos[:, t:t + 1], past_key_values=cache)
        pieces.append(lg)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


def test_init_from_target_copies_and_maps_rows(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    d2t = tiny_d2t(target.config.vocab_size, 100)
    head = build_head(draft_cfg("eagle3"), target.config, d2t=d2t).init_from_target(target)
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    rows = torch.arange(100) + d2t
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[rows])
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    mtp = build_head(draft_cfg("mtp", num_steps=2), target.config).init_from_target(target)
    assert torch.equal(mtp.lm_head.weight, target.get_output_embeddings().weight)
    assert torch.equal(mtp.layers[1].norm.weight, target.model.norm.weight)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp"])
def test_save_load_roundtrip(tmp_path, kind):
    torch.manual_seed(1)
    tc = tiny_target_config("qwen2")
    head = build_head(draft_cfg(kind, num_steps=2), tc, aux_layers=[1, 3, 4],
                      d2t=tiny_d2t() if kind == "eagle3" else None, target_identity="abc123")
    save_draft(tmp_path / "d", head, {"step": 7})
    loaded, meta = load_draft(tmp_path / "d")
    assert meta["step"] == 7 and meta["target_identity"] == "abc123" and meta["aux_layers"] == [1, 3, 4]
    assert (tmp_path / "d" / "vocab.safetensors").is_file() == (kind == "eagle3")
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    batch = synthetic_batch()
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    feat = head.project(batch["aux_hidden"] if kind == "eagle3" else batch["last_hidden"])
    assert torch.equal(head.step(1, batch["input_ids"], feat, pos)[1], loaded.step(1, batch["input_ids"], feat, pos)[1])
    assert not loaded.embed_tokens.weight.requires_grad


def test_load_rejects_non_draft_and_reports_differences(tmp_path):
    with pytest.raises(EyasError, match="not a draft checkpoint"):
        load_draft(tmp_path)
    tc = tiny_target_config()
    eagle3 = head_class("eagle3")
    a = eagle3.head_config(draft_cfg("eagle3"), tc, [2, 3, 3], 200, "id1")
    b = eagle3.head_config(draft_cfg("eagle3"), tiny_target_config(hidden_size=32), [2, 3, 3], 200, "id2")
    diffs = b.resume_differences(a)
    assert any(d.startswith("hidden_size: checkpoint 64 vs this run 32") for d in diffs)
    assert any(d.startswith("target_identity") for d in diffs)


def test_bad_d2t_is_refused():
    tc = tiny_target_config()
    bad = tiny_d2t()
    bad[-1] = 10_000
    with pytest.raises(EyasError, match="outside the target vocabulary"):
        build_head(draft_cfg("eagle3"), tc, d2t=bad)


def test_init_layers_from_target_copies_what_fits_and_says_what_it_kept():
    from eyas.draft.head import init_layers_from_target

    torch.manual_seed(0)
    tc = tiny_target_config()
    hidden, inter = tc.hidden_size, tc.intermediate_size
    heads_dim = tc.num_attention_heads * (hidden // tc.num_attention_heads)
    kv_dim = tc.num_key_value_heads * (hidden // tc.num_attention_heads)
    layer = {"self_attn.q_proj.weight": torch.randn(heads_dim, hidden), "self_attn.k_proj.weight": torch.randn(kv_dim, hidden),
             "self_attn.v_proj.weight": torch.randn(kv_dim, hidden), "self_attn.o_proj.weight": torch.randn(hidden, heads_dim),
             "mlp.gate_proj.weight": torch.randn(inter, hidden), "mlp.up_proj.weight": torch.randn(inter, hidden),
             "mlp.down_proj.weight": torch.randn(hidden, inter), "input_layernorm.weight": torch.rand(hidden),
             "post_attention_layernorm.weight": torch.rand(hidden)}
    eagle = build_head(draft_cfg("eagle"), tc)  # EAGLE-1's layer 0 has no input norm: nothing takes that tensor
    copied, kept = init_layers_from_target(eagle, layer)
    assert sorted(copied) == sorted(f"layers.0.{n}" for n in layer if n != "input_layernorm.weight") and kept == []
    assert torch.equal(eagle.layers[0].mlp.up_proj.weight, layer["mlp.up_proj.weight"])
    narrow = build_head(draft_cfg("eagle3", intermediate_size=inter // 2), tc, d2t=tiny_d2t())
    fc_before = narrow.fc.weight.clone()
    copied, kept = init_layers_from_target(narrow, layer)
    assert sorted(kept) == [f"midlayer.mlp.{n}_proj.weight" for n in ("down", "gate", "up")]  # another width
    assert "midlayer.self_attn.k_proj.weight (feature half)" in copied and "midlayer.hidden_norm.weight" in copied
    assert torch.equal(narrow.fc.weight, fc_before)  # not a layer tensor: untouched


def test_a_kind_declares_its_layout_as_its_registry_line_does(monkeypatch):
    """Each kind's class declares its layout; the registry line repeats it for the torch-free recipe checks, and a
    class that declares none of its own (or another) is refused when it is defined."""
    from eyas.draft.eagle import EagleHead
    from eyas.draft.layouts import LAYER_PER_STEP
    from eyas.draft.registry import KINDS, Kind

    for kind, line in KINDS.items():
        assert head_class(kind).__dict__["layout"] is line.layout
    monkeypatch.setitem(KINDS, "stray", Kind(__name__, LAYER_PER_STEP))
    with pytest.raises(EyasError, match="kind 'stray'.*should declare layout = LAYER_PER_STEP in its own class"):
        type("StrayHead", (EagleHead,), {"kind": "stray"})  # inherits eagle's layout, declares none


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp", "peagle", "dflash", "dspark"])
def test_a_head_declares_its_layers_projection_and_final_norms(kind):
    """What the memory plan and the target-layer init ask of a head, declared: its decoder layers (each an attention
    and an MLP), the Linear that projects the target's feature (None: mtp) and the norms the target's final norm
    starts."""
    tc = tiny_target_config()
    head = build_head(draft_cfg(kind), tc, d2t=None)
    layers = head.decoder_layers()
    assert layers and all(isinstance(m.self_attn, torch.nn.Module) and isinstance(m.mlp, torch.nn.Module) for m in layers)
    found = [m for m in head.modules() if "self_attn" in m._modules and "mlp" in m._modules]
    assert [id(m) for m in layers] == [id(m) for m in found]
    assert (head.projection is None) == (kind == "mtp")
    assert head.projection is None or head.projection is head.fc
    assert (not head.final_norms()) == (kind == "eagle")  # EAGLE-1 regresses the post-norm feature: no final norm
