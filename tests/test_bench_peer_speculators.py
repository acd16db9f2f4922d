"""The glue of benchmarks/bench_peer_speculators.py that needs neither speculators nor vLLM: the
batch order it hands the peer, the loss-mask shift, and the acceptance figures from vLLM's counters."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas.train.loader import TokenBudgetLoader
from eyas.train.ttt import step_counts

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # its `from machine import ...`
    try:
        spec = importlib.util.spec_from_file_location("bench_peer_speculators", BENCH / "bench_peer_speculators.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_peer_speculators", None)
        sys.path.remove(str(BENCH))


class _Lengths:
    """What TokenBudgetLoader reads to plan batches: the sample lengths."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.lengths)


def test_order_is_eyas_loader_batches_per_epoch(bench):
    reader = _Lengths([int(n) for n in np.random.default_rng(0).integers(5, 300, size=97)])
    order = bench.EyasOrder(TokenBudgetLoader(reader, 2048, seed=3))
    reference = TokenBudgetLoader(reader, 2048, seed=3)
    for epoch in (0, 1, 2):
        order.set_epoch(epoch)
        reference.set_epoch(epoch)
        got = list(order)
        assert got == [[int(i) for i in b] for b in reference._rank_batches()]
        assert len(order) == len(got)
        assert sorted(i for b in got for i in b) == list(range(len(reader)))
        assert all(max(reader.lengths[b]) * len(b) <= 2048 for b in got)
    order.set_epoch(0)
    first = list(order)
    order.set_epoch(1)
    assert list(order) != first  # shuffled per epoch, as eyas trains


def test_peer_mask_counts_the_positions_eyas_counts(bench):
    """After speculators' shift (drop token 0) step k reads mask[k:]; that is eyas's mask[k+2:]."""
    mask = (torch.rand(57, generator=torch.Generator().manual_seed(1)) > 0.4).float()
    peer = bench.peer_loss_mask(mask)
    assert peer.dtype == torch.bool and peer.shape == mask.shape and not peer[-1]
    shifted = peer[1:].float()
    eyas = [float(c) for c in step_counts(mask[None], 3)]
    assert [float(shifted[k:].sum()) for k in range(3)] == eyas


def test_figures_from_vllm_counters(bench):
    groups = [{"drafts": 10, "draft_tokens": 30, "accepted": 12, "accepted_per_pos": [6, 4, 2], "tokens": 40,
               "seconds": 2.0, "outputs": [[1], [2]]},
              {"drafts": 10, "draft_tokens": 30, "accepted": 3, "accepted_per_pos": [2, 1, 0], "tokens": 20,
               "seconds": 1.0, "outputs": [[3]]}]
    total = bench.summed(groups)
    assert total["accepted_per_pos"] == [8, 5, 2] and total["drafts"] == 20 and total["prompts"] == 3
    fig = bench.figures(total)
    assert fig["mean_acceptance_length"] == pytest.approx(1 + 15 / 20)
    assert fig["acceptance_per_position"] == pytest.approx([0.4, 0.25, 0.1])
    assert fig["alpha"] == pytest.approx([0.4, 5 / 8, 2 / 5])
    assert bench.figures({"drafts": 0, "accepted": 0, "accepted_per_pos": [], "tokens": 0})["mean_acceptance_length"] == 1.0


def test_dflash_peer_reads_eyas_mask_unshifted(bench):
    """speculators' DFlash scores the block slot at position p on token p where mask[p] is set, and
    anchors only where it is set: eyas's own convention, so the mask goes across as it is."""
    mask = (torch.rand(41, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    peer = bench.same_positions(mask)
    assert peer.dtype == torch.bool and torch.equal(peer, mask > 0)
    assert bench.KINDS["dflash"].mask_glue is bench.same_positions and bench.KINDS["dflash"].preprocess is None
    assert bench.KINDS["eagle3"].mask_glue is bench.peer_loss_mask


def test_dflash_peer_takes_eyas_drafts_shape(bench):
    import argparse

    shape = bench.dflash_shape(argparse.Namespace(), {}, {"num_layers": 2, "num_steps": 3, "mask_token_id": 49151})
    assert shape == {"speculator_type": "dflash", "num_layers": 2, "full_attention_indices": [0, 1], "block_size": 4,
                     "mask_token_id": 49151}
    overrides = [o.format(k=3) for o in bench.KINDS["dflash"].eyas_overrides]
    assert overrides == ["draft.kind=dflash", "draft.num_steps=3"]


def _speculators_dflash_config(layer_types: list[str]) -> dict:
    return {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 15, 27], "mask_token_id": 49151,
            "draft_vocab_size": 4096, "sliding_window_non_causal": False,
            "transformer_layer_config": {"model_type": "qwen3", "layer_types": layer_types}}


def test_peer_dflash_config_serves_non_causal_in_vllm(bench, tmp_path):
    """vLLM's own reader of speculators configs: causal on every layer before the fix, non-causal after."""
    import json

    from vllm.transformers_utils.configs.speculators.algos import update_dflash

    (tmp_path / "config.json").write_text(json.dumps(_speculators_dflash_config(["full_attention"])))
    served: dict = {}
    update_dflash(json.loads((tmp_path / "config.json").read_text()), served)
    assert served["dflash_config"]["causal"] is True  # what vLLM 0.32 would do with speculators' saved config
    bench.serve_as_trained(tmp_path)
    served = {}
    update_dflash(json.loads((tmp_path / "config.json").read_text()), served)
    assert served["dflash_config"]["causal"] is False
    assert served["dflash_config"]["target_layer_ids"] == [1, 14, 26]


def test_peer_dflash_config_with_sliding_layers_refused(bench, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(_speculators_dflash_config(["sliding_attention", "full_attention"])))
    with pytest.raises(SystemExit, match="sliding layers"):
        bench.serve_as_trained(tmp_path)


def test_unshipped_mask_vector_is_expected_unloaded(bench, tmp_path):
    from eyas.eval.engine_vllm import draft_run

    run = bench.without_mask_file(draft_run("peer", tmp_path, "dflash", 3))
    assert "mask_embedding" in run.shared and "embed_tokens.weight" in run.shared
    (tmp_path / "mask_embedding.pt").write_bytes(b"")
    assert "mask_embedding" not in bench.without_mask_file(draft_run("eyas", tmp_path, "dflash", 3)).shared


@pytest.mark.bench
def test_speculators_loads_the_dspark_export_with_equal_logits(tmp_path):
    """speculators 0.9.0's own DSpark model class (installed apart from eyas's environment, from the registry) loads
    an eyas dspark export as written and gives the eyas head's logits and confidences on every (anchor, row) pair,
    the Markov bias changing many of the drafts (benchmarks/crossload_speculators.py)."""
    import json
    import subprocess

    out = tmp_path / "crossload.json"
    done = subprocess.run([sys.executable, str(BENCH / "crossload_speculators.py"), "--peers", str(tmp_path / "peers"),
                           "--out", str(out), "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["peer"] == ["speculators==0.9.0", "hs-connectors==0.9.0"]  # the real peer, not the stand-in
    result = report["result"]
    assert result["equal"] and result["pairs"] >= 300 and result["argmax_changed_by_markov"] > result["pairs"] // 4
    assert not report["loading"]["unused_in_export"] and not report["loading"]["nan_left"]
