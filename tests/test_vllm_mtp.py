"""Slow: eyas's per-step `mtp` draft served by a real vLLM through eyas's plugin, with eyas's acceptance.

A 3-layer mtp draft (target feed: every layer reads the target's last hidden state; full
vocabulary: engines run MTP through the target's lm_head) is trained on the parity tests' data
beside their other drafts (`tests/test_vllm_parity.py`, `BESIDE["mtp"]`), exported with
`eyas export --to vllm` and served by vLLM's offline engine through the plugin
`eyas.serving.vllm_mtp` (entry point `vllm.general_plugins: eyas_mtp`, driven by vLLM's
Step3p5MTPProposer), in the fp32 measurement every parity draft shares (one eyas eval, one
vLLM process). The `chain` feed runs through the same code (layer k-1's output instead of the
target's feature): EYAS_MTP_FEED=chain runs these tests with it. At temperature 0 with
num_speculative_tokens K in {1, 3} they check:

- the plugin was loaded and drove the draft: vLLM's log has the plugin's init line (layers,
  steps, feed) and its load line with every tensor loaded and none missing (the plugin raises on
  an unexpected tensor, vLLM's loader on a missing one), and no warning while loading the draft;
- every output equals the target's greedy output in the same engine;
- vLLM's accepted tokens per position equal `eyas eval` with shape `chain:K` on the same prompts
  within `eyas.eval.engine_vllm.parity_tolerance`, and are well above zero at every depth.

vLLM must be installed (the README's test command installs it); these tests fail rather than skip when it is
missing or cannot start. Both engines' figures go to the test log (`-s`) and to
`<tmp>/vllm_parity.json` (or EYAS_PARITY_RESULTS); EYAS_PARITY_RUN_DIR keeps the trained drafts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_vllm_parity import MTP_FEED, MTP_LAYERS, SERVED

# Training the drafts runs in the first test's fixture: past the suite's 900 s default.
pytestmark = [pytest.mark.slow, pytest.mark.serving, pytest.mark.timeout(3600)]

KS = SERVED["float32"]["mtp"]


def plugin_lines(log: Path) -> dict[str, list[str]]:
    """The plugin's own lines in vLLM's log, per run (EYAS_RUN_BEGIN marks a run's start)."""
    runs: dict[str, list[str]] = {}
    current = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("EYAS_RUN_BEGIN "):
            current = line[len("EYAS_RUN_BEGIN "):]
            runs[current] = []
        elif current and line.startswith(("EYAS_MTP_INIT", "EYAS_MTP_LOADED")):
            runs[current].append(line)
    return runs


@pytest.fixture(scope="module")
def mtp_parity(served) -> dict:
    report = served("float32")
    return {**report, "plugin": plugin_lines(Path(report["log"])), "export": report["exports"]["mtp"]}


def test_the_export_is_a_vllm_mtp_draft_for_the_plugin(mtp_parity):
    config = json.loads((Path(mtp_parity["export"]) / "config.json").read_text())
    assert config["architectures"] == ["EyasLlamaMTP"] and config["model_type"] == "step3p5_mtp"
    assert config["num_nextn_predict_layers"] == MTP_LAYERS and config["eyas"]["mtp_feed"] == MTP_FEED
    assert (Path(mtp_parity["export"]) / "eyas_export.json").is_file()


@pytest.mark.parametrize("k", KS)
def test_vllm_serves_the_mtp_export_with_eyas_acceptance(mtp_parity, k):
    name = f"mtp chain:{k}"
    row = mtp_parity["rows"][name]
    lines = mtp_parity["plugin"].get(name, [])
    # The plugin built the model (one layer per step, K steps, the draft's feed) and loaded every tensor.
    init = [x for x in lines if x.startswith("EYAS_MTP_INIT")]
    assert init and f"layers={MTP_LAYERS} steps={k} feed={MTP_FEED}" in init[0], lines
    loaded = [re.search(r"tensors=(\d+) missing=(\d+)", x) for x in lines if x.startswith("EYAS_MTP_LOADED")]
    written = json.loads((Path(mtp_parity["export"]) / "eyas_export.json").read_text())["tensors"]
    assert loaded and loaded[0] and int(loaded[0][1]) == written and int(loaded[0][2]) == 0, (lines, written)
    assert row["vllm"]["unloaded"] == [] and row["vllm"]["load_warnings"] == []
    # Every speculative output equals the target's greedy output in the same engine.
    assert row["vllm_equals_vllm_target"] == mtp_parity["prompts"], row
    assert row["eyas"]["matched"] == row["eyas"]["compared"] == mtp_parity["prompts"], row
    # Per-position counters over K positions; every depth exercised: a random draft accepts nothing,
    # this one (2 epochs on 224 samples) 0.26 / 0.077 / 0.045 at depths 1-3 when measured.
    assert len(row["vllm"]["accepted_per_pos"]) == k
    for fig in (row["vllm"], row["eyas"]):
        assert all(c > 0.03 for c in fig["cumulative"]) and all(a >= 5 for a in fig["accepted_per_pos"]), fig
    for d, (ours, theirs, tol) in enumerate(zip(row["eyas"]["cumulative"], row["vllm"]["cumulative"],
                                                row["tolerance"]), start=1):
        assert abs(ours - theirs) <= tol, (f"mtp K={k} {mtp_parity['dtype']} depth {d}: eyas {ours:.4f}, "
                                           f"vLLM {theirs:.4f}, tolerance {tol:.4f}")
