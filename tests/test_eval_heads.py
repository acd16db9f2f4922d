"""The trained-head adapter (eagle, eagle3, mtp) against the training semantics, and its refusals.

* A chain drafted through the adapter (KV cache, tree masks, commits) gives the same logits
  as running the head over the whole sequence without a cache the way `eyas.train.ttt`
  unrolls it in training (eagle3: TTTCache and the draft's own argmax tokens; mtp: causal
  per layer and data tokens).
* Greedy decoding with each kind, chain / static / dynamic, equals the target's greedy decode.
* A checkpoint made for another target is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from eyas.decode import SamplingParams, stop_token_ids
from eyas.draft.blocks import TTTCache
from eyas.draft.checkpoint import save_draft
from eyas.draft.features import default_layers
from eyas.draft.registry import build_head, head_class
from eyas.errors import EyasError
from eyas.eval.decoder import SpeculativeDecoder, target_generate
from eyas.eval.head_draft import load_head_draft
from eyas.recipe_kinds import draft_config
from eyas.shapes import parse_shape
from eyas.targets import load_target_config, target_identity

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def make_checkpoint(folder, target_dir, kind, mtp_feed="chain", reduced_vocab=False, seed=0):
    """A randomly initialised head of `kind` for the target in `target_dir`, saved as a draft directory."""
    target, tokenizer = load(target_dir)
    torch.manual_seed(seed)
    d2t = None
    if reduced_vocab:
        kept = torch.randperm(target.config.vocab_size)[:200].sort().values
        d2t = kept - torch.arange(len(kept))
    config = load_target_config(str(target_dir))
    feed = {"mtp_feed": mtp_feed} if kind == "mtp" else {}  # mtp's own key: another kind refuses it
    head = build_head(draft_config(kind=kind, num_steps=4, **feed), config,
                      default_layers(config.num_hidden_layers) if head_class(kind).feature_spec.fused_layers else None, d2t,
                      target_identity(config, tokenizer))
    head.init_from_target(target)
    with torch.no_grad():  # sharpen the random head so logits depend on positions and masks
        head.lm_head.weight.mul_(3.0)
        for name, param in head.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10.0)
    return save_draft(folder, head, {"step": 0})


KINDS = [("eagle3", "chain", True), ("eagle", "chain", False), ("mtp", "chain", False), ("mtp", "target", True)]


@pytest.mark.parametrize("kind,feed,reduced", KINDS, ids=["eagle3", "eagle", "mtp_chain", "mtp_target"])
def test_adapter_chain_matches_training_unroll(tmp_path, tiny_llama_dir, kind, feed, reduced):
    target, tokenizer = load(tiny_llama_dir)
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_llama_dir, kind, feed, reduced)
    draft = load_head_draft(ckpt, target, tokenizer, target_path=str(tiny_llama_dir))
    head = draft.head
    depth = 4  # every layer of the 4-step mtp heads; eagle/eagle3 reuse their one layer
    generator = torch.Generator().manual_seed(1)
    sequence = torch.randint(3, target.config.vocab_size, (16 + depth + 1,), generator=generator)
    L = 16
    with torch.inference_mode():
        hidden_states = target(sequence[None], output_hidden_states=True).hidden_states
        features = torch.cat([hidden_states[i][0] for i in draft.feature_layers], dim=-1)
        # adapter: start on the prompt with root x_L, then draft a chain (greedy for eagle, data tokens for mtp)
        got = [draft.start(sequence[:L], int(sequence[L]), features[:L])]
        chain = []
        for d in range(1, depth):
            token = int(got[-1].argmax()) if kind != "mtp" else int(sequence[L + d])
            chain.append(token)
            got.append(draft.expand([d - 2], [token])[0])
        # reference: the training unroll over the whole prefix x_0..x_L, read at the last slot L-1
        tokens = sequence[1:L + 1][None]
        positions = torch.arange(L)[None]
        feature = first = head.project(features[:L][None]) if kind == "eagle3" else features[:L][None]
        cache = TTTCache() if kind != "mtp" else None
        want = []
        for k in range(depth):
            if kind == "mtp":  # data tokens x_{t+k+1}: the prefix continued by the sequence itself
                tokens = sequence[k + 1:L + k + 1][None]
            hidden, logits = head.step(k, tokens, feature, positions + k, past_key_values=cache)
            want.append(draft._to_target(logits[0, -1:])[0])
            feature = first if (kind == "mtp" and feed == "target") else hidden
            if kind != "mtp":
                tokens = head.draft_to_target(logits.argmax(-1))
    for k, (a, b) in enumerate(zip(got, want)):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        assert torch.allclose(a[finite], b[finite], atol=1e-4, rtol=1e-4), f"{kind} depth {k + 1}"
    if kind != "mtp":
        assert chain == [int(w.argmax()) for w in want[:-1]]


@pytest.mark.parametrize("kind,feed,reduced", KINDS, ids=["eagle3", "eagle", "mtp_chain", "mtp_target"])
def test_greedy_with_heads_equals_target_greedy(tmp_path, tiny_qwen2_dir, kind, feed, reduced):
    target, tokenizer = load(tiny_qwen2_dir)
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_qwen2_dir, kind, feed, reduced)
    draft = load_head_draft(ckpt, target, tokenizer, target_path=str(tiny_qwen2_dir))
    eos = stop_token_ids(target)
    generator = torch.Generator().manual_seed(2)
    shapes = ["chain:3", "tree:[[0],[1],[0,0],[1,0],[0,0,0]]", "dynamic:depth=3,topk=3,nodes=8"]
    for n_prompt, n_new in ((5, 20), (23, 31)):
        prompt = torch.randint(3, target.config.vocab_size, (n_prompt,), generator=generator)
        reference = target_generate(target, prompt, n_new, GREEDY, eos)
        for spec in shapes:
            result = SpeculativeDecoder(target, draft, parse_shape(spec), GREEDY, eos).generate(prompt, n_new)
            assert result.tokens == reference, f"{kind} {spec}"


def test_head_for_another_target_is_refused(tmp_path, tiny_llama_dir, tiny_qwen2_dir):
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_qwen2_dir, "eagle3")
    target, tokenizer = load(tiny_llama_dir)
    with pytest.raises(EyasError, match="made for another target: target identity"):
        load_head_draft(ckpt, target, tokenizer, target_path=str(tiny_llama_dir))


def test_mtp_deeper_than_its_layers_is_refused(tmp_path, tiny_llama_dir):
    target, tokenizer = load(tiny_llama_dir)
    draft = load_head_draft(make_checkpoint(tmp_path / "c", tiny_llama_dir, "mtp"), target, tokenizer)
    with pytest.raises(EyasError, match="drafts at most 4 tokens deep"):
        SpeculativeDecoder(target, draft, parse_shape("chain:5"), GREEDY, stop_token_ids(target))


def test_no_stage_probes_a_head_or_a_draft():
    """The stages ask a head (`eyas.draft.head.DraftHead`) and a draft (`eyas.eval.drafts.Draft`) what they declare:
    no `hasattr` / `getattr` on one outside eyas/draft/ (those left read caches, configs and a target's modules)."""
    import re
    from pathlib import Path

    from eyas.eval.drafts import Draft, LMDraft
    from eyas.eval.head_draft import ADAPTERS

    root = Path(__file__).resolve().parents[1]
    probe = re.compile(r"(hasattr|getattr)\((self\.)?(head|draft|adapter|drafts?\.\w+)\b")
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}" for folder in ("data", "train", "eval", "cli")
             for path in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert not found, "probes of a head or a draft:\n" + "\n".join(found)
    for cls in (LMDraft, *ADAPTERS.values()):  # every draft declares what the decoder asks
        assert issubclass(cls, Draft)
    assert not LMDraft.gives_confidence and LMDraft.max_depth is None and LMDraft.feature_layers is None
