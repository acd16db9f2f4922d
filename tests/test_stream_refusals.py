"""`train.source: stream` refusals that need no engine: the recipe's engines from one place, a file stamped by another
target, no engine answering, and the loader's window (tests/test_stream.py runs the rest against real engines)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from eyas.config import load_recipe
from eyas.errors import EyasError
from eyas.train.engines import IDENTITY_KEY, Engine, EngineFleet
from eyas.train.loader import asked_ahead
from eyas.vllm_server import free_port


@pytest.mark.parametrize("overrides, message", [
    (["train.stream_engines=0"], "not both and not neither"),
    (["train.stream_endpoints=[http://a:1/v1]"], "not both and not neither"),
    (["train.stream_engines=0", "train.stream_endpoints=[a:1]"], "must be a list of engine URLs"),
    (["dump.teacher=topk"], "captures no top-k teacher"),
    (["train.stream_cache=sometimes"], "train.stream_cache"),
])
def test_a_stream_recipe_names_what_is_wrong(overrides, message):
    with pytest.raises(EyasError, match=message):
        load_recipe(None, ["train.source=stream", *overrides])


def _fleet(tmp_path, urls, timeout_s=2.0) -> EngineFleet:
    return EngineFleet(urls, tmp_path, expect_identity="run-target", expect_layers=[2, 4, 5, 8], timeout_s=timeout_s,
                       workers=2)


def test_a_file_from_another_target_or_layers_is_refused_with_the_fix(tmp_path):
    fleet = _fleet(tmp_path, ["http://127.0.0.1:1/v1"])
    engine = Engine("http://e:1/v1")
    payload = {"token_ids": torch.tensor([5, 6]), "hidden_states": torch.zeros(2, 4, 8)}
    try:
        with pytest.raises(EyasError, match=r"engine at http://e:1/v1 captures another target or tokenizer "
                                            r"\(identity other-target, this run's target is run-target\).*eyas engine"):
            fleet._check(engine, {IDENTITY_KEY: "other-target", "eyas_layer_ids": "[2, 4, 5, 8]"}, payload, [5, 6])
        with pytest.raises(EyasError, match=r"captures layers \[1, 3, 5, 8\], this run reads \[2, 4, 5, 8\]"):
            fleet._check(engine, {IDENTITY_KEY: "run-target", "eyas_layer_ids": "[1, 3, 5, 8]"}, payload, [5, 6])
        with pytest.raises(EyasError, match="another sample's tokens"):
            fleet._check(engine, {IDENTITY_KEY: "run-target", "eyas_layer_ids": "[2, 4, 5, 8]"}, payload, [5, 7])
    finally:
        fleet.close()


def test_no_engine_answering_is_an_error_naming_each_after_the_timeout(tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}/v1"]
    fleet = _fleet(tmp_path, urls)
    started = time.monotonic()
    try:
        with pytest.raises(EyasError, match=r"no engine answered sample 3 in 2 s.*eyas engine RECIPE") as refused:
            fleet.submit(3, [1, 2], lambda hidden: {"h": hidden}).result(timeout=60)
    finally:
        fleet.close()
    assert all(f"{url}: [Errno 111] Connection refused" in str(refused.value) for url in urls)
    assert time.monotonic() - started < 30
    assert fleet.counts.retries >= 2 and fleet.counts.captures == 0


class _Asked:
    """A reader that records what the window asks."""

    def __init__(self, window: int) -> None:
        self.window, self.asked = window, []

    def request(self, indices) -> None:
        self.asked += list(indices)


def test_the_window_asks_ahead_as_far_as_it_allows_and_no_further():
    plan = ((0, n + 1, np.array([2 * n, 2 * n + 1])) for n in range(1000))  # endless in effect: batches of 2
    reader = _Asked(window=6)
    ahead = asked_ahead(plan, reader)
    first = next(ahead)
    assert first[2].tolist() == [0, 1] and reader.asked == [0, 1, 2, 3, 4, 5]  # 3 batches = the window
    next(ahead)
    assert reader.asked[-2:] == [6, 7] and len(reader.asked) == 8  # one batch handed on, one more asked
