"""The draft's RoPE is the target's: same frequencies, same scaling, after a save and a reload.

A draft trained with other rotary frequencies than the engine serves it with (the export writes
the target's RoPE) loses acceptance silently, worst at long context. transformers 4.x took the
scaling from `rope_theta`/`rope_scaling` and ignored `rope_parameters`, which is why eyas's floor is
5.16.1; these tests hold the draft to the target's own rotary module on the real settings of the
8B recipes' targets, past the original context length where llama3 scaling bends the curve.
"""

from __future__ import annotations

import pytest
import torch
from train_helpers import draft_cfg
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from eyas.draft.checkpoint import load_draft, save_draft
from eyas.draft.registry import build_head

# Llama-3.1-8B-Instruct's and Qwen3-8B's published RoPE settings, at one 128-wide head (the real head_dim).
LLAMA31 = dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               max_position_embeddings=131072)
QWEN3 = dict(rope_theta=1000000.0, max_position_embeddings=40960)
SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=1,
             num_key_value_heads=1, head_dim=128)


def target_config(family: str):
    if family == "llama3.1":
        return LlamaConfig(**SHAPE, **LLAMA31), LlamaRotaryEmbedding
    return Qwen3Config(**SHAPE, **QWEN3), Qwen3RotaryEmbedding


@pytest.mark.parametrize("family", ["llama3.1", "qwen3"])
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_draft_rotary_equals_the_targets_after_reload(family, kind, tmp_path):
    config, rotary_class = target_config(family)
    reference = rotary_class(config)
    head, _ = load_draft(save_draft(tmp_path / "draft", build_head(draft_cfg(kind), config)))
    assert torch.equal(head.rotary_emb.inv_freq, reference.inv_freq)
    assert head.rotary_emb.attention_scaling == reference.attention_scaling
    # Positions on both sides of the original 8K window (llama3 scaling acts on the long wavelengths).
    positions = torch.tensor([[0, 1, 4095, 8191, 8192, 30000, 120000]])
    x = torch.zeros(1, positions.shape[1], 128)
    for ours, theirs in zip(head.rotary_emb(x, positions), reference(x, positions)):
        assert torch.equal(ours, theirs)


def test_llama3_scaling_is_not_plain_rope():
    """The comparison above can fail: llama3 scaling moves the long-wavelength frequencies."""
    scaled, _ = target_config("llama3.1")
    plain = LlamaConfig(**SHAPE, rope_theta=500000.0, max_position_embeddings=131072)
    assert not torch.equal(LlamaRotaryEmbedding(scaled).inv_freq, LlamaRotaryEmbedding(plain).inv_freq)
    head = build_head(draft_cfg("eagle3"), scaled)
    assert not torch.equal(head.rotary_emb.inv_freq, LlamaRotaryEmbedding(plain).inv_freq)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_a_head_cast_to_low_precision_keeps_fp32_frequencies(cast):
    """DeepSpeed's bf16/fp16 casts the whole module (`module.bfloat16()`), buffers included: the frequencies
    stay the target's fp32 ones, so the angles at long positions are those the engines serve with."""
    config, rotary_class = target_config("llama3.1")
    reference = rotary_class(config)
    head = getattr(build_head(draft_cfg("eagle3"), config), cast)()
    assert head.fc.weight.dtype != torch.float32  # the cast reached the weights
    assert head.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary_emb.inv_freq, reference.inv_freq)
    positions = torch.tensor([[8191, 120000]])
    x = torch.zeros(1, 2, 128)
    assert torch.equal(head.rotary_emb(x, positions)[0], reference(x, positions)[0])
    # what a plain cast would have done: the angles at position 120000 off by radians
    plain = rotary_class(config).bfloat16()
    assert not torch.equal(plain(x, positions)[0], reference(x, positions)[0])
