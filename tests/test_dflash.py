"""The dflash head (a block of tokens per forward): training and eval agree, decoding is lossless,
training learns, the vLLM export round-trips, and the recipe rules refuse what cannot be served.

vLLM serving it with eyas's acceptance is `tests/test_vllm_parity.py::test_vllm_serves_the_dflash_export`.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import random_head, target_batch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas.config import from_dict
from eyas.decode import SamplingParams, stop_token_ids
from eyas.draft.checkpoint import save_draft
from eyas.draft.head import init_layers_from_target
from eyas.draft.registry import build_head
from eyas.errors import EyasError
from eyas.eval.decoder import SpeculativeDecoder, target_generate
from eyas.eval.head_draft import BlockDraft, load_head_draft
from eyas.recipe_checks import parse_loss_mix
from eyas.recipe_kinds import draft_config
from eyas.shapes import parse_shape
from eyas.train.export import export_draft, load_exported
from eyas.train.losses import Teacher
from eyas.train.ttt import block_steps, unroll

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)
SLOTS = 3


def _target(path):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _head(target_dir, layers: int = 2, seed: int = 0, sharpen: bool = True, reduced: bool = False):
    """A random dflash head (SLOTS mask slots), sharpened (attention and a random mask vector) unless
    `sharpen` is false; `reduced`: over a 200-token draft vocabulary."""
    d2t = None
    if reduced:
        kept = torch.randperm(384, generator=torch.Generator().manual_seed(seed))[:200].sort().values
        d2t = kept - torch.arange(len(kept))
    head, target, tokenizer = random_head(target_dir, "dflash", d2t, seed, sharpen, num_steps=SLOTS, num_layers=layers)
    if sharpen:
        with torch.no_grad():
            head.mask_embedding.normal_()
    return head, target, tokenizer


def _training_logits(head, sequence, features) -> list[torch.Tensor]:
    """Per unroll step, the training forward's logits [1, T, V] over one sequence."""
    return [logits for logits, _ in block_steps(head, sequence[None], features[None], SLOTS)]


def _features(target, sequence, layers):
    with torch.inference_mode():
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in layers], dim=-1)


def test_block_draft_equals_the_training_forward(tiny_llama_dir):
    """The eval adapter's block after root x_L (context cached, extended on commit) gives the logits the
    training forward gives every slot of the block anchored at L: training and drafting are one computation."""
    head, target, _ = _head(tiny_llama_dir)
    draft = BlockDraft(head.eval(), "dflash")
    sequence = torch.randint(3, target.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    features = _features(target, sequence, draft.feature_layers)
    with torch.inference_mode():
        train = _training_logits(head, sequence, features)
        L = 12
        got = [draft.start(sequence[:L], int(sequence[L]), features[:L])]
        got += [draft.expand([d - 2], [7])[0] for d in range(1, SLOTS)]  # any token: slots do not read them
        after = draft.commit([0, 1], [int(sequence[L + 1]), int(sequence[L + 2])], int(sequence[L + 3]),
                             features[L:L + 3])
    for k in range(SLOTS):
        torch.testing.assert_close(got[k], train[k][0, L - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, train[0][0, L + 2], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        for d in range(1, SLOTS):  # a chain as deep as the slots, after the commit
            draft.expand([d - 2], [7])
    with pytest.raises(EyasError, match="drafts 3 tokens per block"):
        draft.expand([SLOTS - 2], [7])


@pytest.mark.parametrize("layers, reduced", [(1, False), (2, True)])
def test_greedy_with_dflash_equals_target_greedy(tmp_path, tiny_qwen2_dir, layers, reduced):
    head, target, tokenizer = _head(tiny_qwen2_dir, layers=layers, reduced=reduced)
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0})
    draft = load_head_draft(checkpoint, target, tokenizer, target_path=str(tiny_qwen2_dir))
    eos = stop_token_ids(target)
    generator = torch.Generator().manual_seed(2)
    for n_prompt, n_new in ((5, 20), (23, 31)):
        prompt = torch.randint(3, target.config.vocab_size, (n_prompt,), generator=generator)
        reference = target_generate(target, prompt, n_new, GREEDY, eos)
        for spec in ("chain:1", "chain:3", "dynamic:depth=3,topk=2,nodes=6"):
            result = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate(prompt, n_new)
            assert result.tokens == reference, spec


def test_training_lowers_the_loss_of_every_slot(tiny_llama_dir):
    """A few AdamW steps on one batch: every slot's loss falls, and the mask vector is trained."""
    head, target, _ = _head(tiny_llama_dir, layers=1, sharpen=False)
    sequence = torch.randint(3, target.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    batch = target_batch(target, sequence, head.config.aux_layers)
    teacher = Teacher(target.get_output_embeddings().weight, None, 64)
    mix = parse_loss_mix("forward_kl")
    start_mask = head.mask_embedding.detach().clone()
    optimizer = torch.optim.AdamW(head.trainable_parameters(), lr=3e-3)

    def losses() -> list[float]:
        out = unroll(head, batch, teacher, SLOTS, mix)
        return [float(s / c) for s, c in zip(out.loss_sums, out.counts)], out

    before, _ = losses()
    for _ in range(40):
        _, out = losses()
        sum(s / c for s, c in zip(out.loss_sums, out.counts)).backward()
        optimizer.step()
        optimizer.zero_grad()
    after, _ = losses()
    assert all(a < 0.7 * b for a, b in zip(after, before)), (before, after)
    assert not torch.equal(head.mask_embedding.detach(), start_mask)


def test_layers_start_from_the_target_layer(tiny_llama_dir):
    """train.draft_init=target_last_layer: every DFlash layer takes the target layer's attention, MLP and
    norms (names and shapes agree); only the q/k norms, which the target lacks, keep theirs."""
    head, target, _ = _head(tiny_llama_dir, sharpen=False)
    source = {name.removeprefix("model.layers.5."): t for name, t in target.state_dict().items()
              if name.startswith("model.layers.5.")}
    copied, kept = init_layers_from_target(head, source)
    assert sorted(kept) == [f"layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in ("k", "q")]
    assert torch.equal(head.layers[1].mlp.down_proj.weight, source["mlp.down_proj.weight"]) and len(copied) == 2 * 9


def test_vllm_export_round_trips(tmp_path, tiny_llama_dir):
    """`eyas export --to vllm` writes vLLM's native DFlash layout (layer ids as layer outputs, the reduced
    vocabulary's lm_head and d2t, the mask vector beside the weights), and reading it back gives the head's
    own logits."""
    head, target, tokenizer = _head(tiny_llama_dir, reduced=True)
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0, "target_path": str(tiny_llama_dir)})
    out = export_draft(checkpoint, "vllm", tmp_path / "vllm", dtype="float32", speculative_tokens=SLOTS)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": head.config.mask_token_id,
                                       "target_layer_ids": [i - 1 for i in head.config.aux_layers]}
    assert config["block_size"] == SLOTS + 1 and config["num_hidden_layers"] == 2 and config["draft_vocab_size"] == 200
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {"lm_head.weight", "d2t", "t2d"} <= set(f.keys()) and "embed_tokens.weight" not in set(f.keys())
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == head.config.mask_token_id and torch.equal(mask["embedding"], head.mask_embedding.detach())
    _assert_same_logits(head, load_exported(out, target.get_input_embeddings().weight), target)
    with pytest.raises(EyasError, match="trained with 3 mask slots"):
        export_draft(checkpoint, "vllm", tmp_path / "deep", dtype="float32", speculative_tokens=SLOTS + 1)
    with pytest.raises(EyasError, match="train it with draft.use_draft_vocab=false draft.train_lm_head=false "
                                        "draft.train_mask_embedding=false to serve it in SGLang"):
        export_draft(checkpoint, "sglang", tmp_path / "sglang", dtype="float32")


# What SGLang 0.5.23's DFlashDraftModel reads per layer (srt/models/dflash.py: q/k/v stacked into
# qkv_proj and gate/up into gate_up_proj at load), besides fc, hidden_norm and norm.
SGLANG_LAYER_TENSORS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                        "input_layernorm.weight", "post_attention_layernorm.weight"}


def test_sglang_export_of_a_draft_on_the_target_rows(tmp_path, tiny_llama_dir):
    """A draft that kept the target's lm_head (full vocabulary) and mask row exports to SGLang's DFlash layout:
    no lm_head and no mask file (SGLang takes both from the target), block_size in dflash_config, the DFLASH
    serving command; read back over the target's tensors it gives the head's own logits."""
    head, target, _ = random_head(tiny_llama_dir, "dflash", num_steps=SLOTS, num_layers=2, use_draft_vocab=False,
                                  train_lm_head=False, train_mask_embedding=False)
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert torch.equal(head.mask_embedding.detach(), embed[head.config.mask_token_id].detach())
    trainable = {id(p) for p in head.trainable_parameters()}
    assert id(head.mask_embedding) not in trainable and id(head.lm_head.weight) not in trainable
    checkpoint = save_draft(tmp_path / "ckpt", head, {"step": 0, "target_path": str(tiny_llama_dir)})
    out = export_draft(checkpoint, "sglang", tmp_path / "sglang", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "draft_vocab_size" not in config
    assert config["dflash_config"] == {"mask_token_id": head.config.mask_token_id, "block_size": SLOTS + 1,
                                       "target_layer_ids": [i - 1 for i in head.config.aux_layers]}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in SGLANG_LAYER_TENSORS}
    assert not list(out.glob("*.pt"))
    serve = json.loads((out / "eyas_export.json").read_text())["serve"]
    assert "--speculative-algorithm DFLASH" in serve and serve.endswith(f"--speculative-num-draft-tokens {SLOTS + 1}")
    with pytest.raises(EyasError, match="sglang dflash export uses the target's lm_head"):
        load_exported(out, embed)
    _assert_same_logits(head, load_exported(out, embed, lm_head), target)


def _assert_same_logits(head, back, target) -> None:
    """`back` (an export read back) gives `head`'s logits at every slot of every block of a random sequence."""
    sequence = torch.randint(3, target.config.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    features = _features(target, sequence, head.config.aux_layers)
    with torch.inference_mode():
        for a, b in zip(_training_logits(head, sequence, features),
                        _training_logits(back, sequence, features)):
            torch.testing.assert_close(a, b)


def test_recipe_rules():
    recipe = from_dict({"draft": {"kind": "dflash", "num_steps": 4}})
    assert recipe.train.ttt_steps == 4  # every mask slot trains
    with pytest.raises(EyasError, match="'draft.train_mask_embedding' is false, but a P-EAGLE draft has no mask vector"):
        from_dict({"draft": {"kind": "peagle", "train_mask_embedding": False}})
    assert not from_dict({"draft": {"kind": "dflash", "train_mask_embedding": False}}).draft.options["train_mask_embedding"]
    with pytest.raises(EyasError, match="block slots 3-4 would get no gradient"):
        from_dict({"draft": {"kind": "dflash", "num_steps": 4}, "train": {"ttt_steps": 2}})
    with pytest.raises(EyasError, match="outside the target's vocabulary"):
        build_head(draft_config(kind="dflash", mask_token_id=10**6),
                   type("Target", (), {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                                       "vocab_size": 384, "max_position_embeddings": 256, "num_hidden_layers": 6})(),
                   [1, 3, 5])
