"""Issue 15, item 6: `auto` precision picks bf16 only where the machine runs it natively."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eyas import precision
from eyas.config import load_recipe
from eyas.errors import EyasError

X86_PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.fixture()
def cpu(monkeypatch):
    """Pretend to be a CPU with (True) or without (False) native bf16, with a given matmul ratio."""
    def set_cpu(native: bool | None, ratio: float = 3.0):
        precision._cpu_native.cache_clear()
        precision._warned.clear()
        monkeypatch.setattr(precision, "cpu_flags", lambda: None if native is None else
                            ({"amx_bf16"} if native else {"avx2"}))
        monkeypatch.setattr(precision, "bf16_ratio", lambda: ratio)
    yield set_cpu
    precision._cpu_native.cache_clear()
    precision._warned.clear()


@pytest.mark.parametrize("text,native", [(X86_PLAIN, False), (X86_AMX, True), (ARM_BF16, True)])
def test_flags_from_cpuinfo(tmp_path, text, native):
    path = tmp_path / "cpuinfo"
    path.write_text(text * 2)
    flags = precision.cpu_flags(path)
    assert precision.cpu_bf16_from_flags(flags) is native
    assert precision.cpu_flags(tmp_path / "missing") is None


def test_auto_follows_the_cpu(cpu):
    cpu(False)
    assert not precision.native_bf16("cpu")
    assert precision.mixed_precision_for("auto", "cpu") == "no"
    assert precision.regenerate_dtype("auto", "auto", "cpu") == "float32"
    cpu(True)
    assert precision.native_bf16("cpu")
    assert precision.mixed_precision_for("auto", "cpu") == "bf16"
    assert precision.regenerate_dtype("auto", "auto", "cpu") == "bfloat16"


@pytest.mark.parametrize("setting,native", [("native", True), ("emulated", False), (" Native ", True)])
def test_the_environment_sets_the_cpus_answer_over_its_flags(cpu, monkeypatch, setting, native):
    """`EYAS_CPU_BF16` makes any CPU take the other machine kind's `auto` path (CI's forced-bf16 step)."""
    cpu(not native)
    monkeypatch.setenv("EYAS_CPU_BF16", setting)
    assert precision.native_bf16("cpu") is native
    assert precision.mixed_precision_for("auto", "cpu") == ("bf16" if native else "no")


def test_a_wrong_environment_setting_names_the_choices(cpu, monkeypatch):
    cpu(True)
    monkeypatch.setenv("EYAS_CPU_BF16", "yes")
    with pytest.raises(EyasError, match="EYAS_CPU_BF16='yes' is not one of native, emulated"):
        precision.native_bf16("cpu")


def test_unreadable_flags_fall_back_to_timing(cpu):
    cpu(None, ratio=4.5)
    assert not precision.native_bf16("cpu")
    cpu(None, ratio=0.6)
    assert precision.native_bf16("cpu")


def test_explicit_settings_are_kept(cpu):
    cpu(False)
    assert precision.mixed_precision_for("fp32", "cpu") == precision.mixed_precision_for("no", "cpu") == "no"
    assert precision.mixed_precision_for("fp16", "cpu") == "fp16"
    assert precision.regenerate_dtype("", "float16", "cpu") == "float16"  # empty: target.dtype
    assert precision.regenerate_dtype("float32", "auto", "cpu") == "float32"


def test_forced_bf16_on_a_cpu_without_it_warns_once_with_the_ratio(cpu, capsys):
    cpu(False, ratio=4.5)
    assert precision.mixed_precision_for("bf16", "cpu") == "bf16"  # obeyed
    assert precision.mixed_precision_for("bf16", "cpu") == "bf16"
    assert precision.regenerate_dtype("bfloat16", "auto", "cpu") == "bfloat16"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "eyas: warning: train.mixed_precision: bf16 on a CPU without native bf16 (no AMX, no AVX512-BF16): a bf16 "
        "matmul takes 4.5x the fp32 time here; set train.mixed_precision: auto to use fp32 on this machine",
        "eyas: warning: data.regenerate_dtype: bfloat16 on a CPU without native bf16 (no AMX, no AVX512-BF16): a "
        "bf16 matmul takes 4.5x the fp32 time here; set data.regenerate_dtype: auto to use fp32 on this machine",
    ]
    cpu(True)
    precision.mixed_precision_for("bf16", "cpu")
    assert capsys.readouterr().err == ""  # native: no warning


def test_cuda_without_bf16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.mixed_precision_for("auto", "cuda") == "no"
    assert precision.regenerate_dtype("auto", "auto", "cuda") == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.mixed_precision_for("auto", "cuda") == "bf16"


def test_the_real_probe_measures_this_machine():
    precision.bf16_ratio.cache_clear()
    ratio = precision.bf16_ratio(size=128, repeats=3)
    assert math.isfinite(ratio) and ratio > 0
    assert isinstance(precision.native_bf16("cpu"), bool)


def test_prepare_regenerates_with_the_machines_dtype(tmp_path, tiny_llama_dir, cpu, monkeypatch):
    """data.regenerate_dtype: auto reaches load_target as bfloat16 on a native CPU, float32 elsewhere."""
    import eyas.data.prepare
    from eyas.data.prepare import prepare

    seen = []

    class Stop(Exception):
        pass

    def fake_load_target(target, device=None):
        seen.append(target.dtype)
        raise Stop

    monkeypatch.setattr(eyas.data.prepare, "load_target", fake_load_target)  # the name prepare calls
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "hello"}]}) + "\n")
    recipe = load_recipe(None, [f"target.path={tiny_llama_dir}", f"data.source={source}", f"run.output_dir={tmp_path}",
                                "data.regenerate=true", "data.regenerate_dtype=auto", "target.device=cpu"])
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        cpu(native)
        with pytest.raises(Stop):
            prepare(recipe)
        assert seen[-1] == expected


def test_quickstart_lets_the_machine_choose():
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "quickstart.yaml")
    assert recipe.data.regenerate_dtype == "auto" and recipe.train.mixed_precision == "auto"
