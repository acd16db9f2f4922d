"""Issue 15, item 2: bytes that are not UTF-8, a BOM, binary files, truncated rows counted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eyas.config import load_recipe
from eyas.data.prepare import load_prepared, main, prepare
from eyas.data.sources import NOT_UTF8, load_rows
from eyas.errors import EyasError


def _row(i: int, answer: str = "Hi there!") -> dict:
    return {"id": f"r{i}", "messages": [{"role": "user", "content": f"Hello {i}"},
                                        {"role": "assistant", "content": answer}]}


def _recipe_file(tmp_path, target, source, *lines: str):
    path = tmp_path / "r.yaml"
    path.write_text(f"target:\n  path: {target}\ndata:\n  source: {source}\n  heldout_fraction: 0.0\n"
                    + "".join(f"  {line}\n" for line in lines) + f"run:\n  output_dir: {tmp_path}/runs\n")
    return path


def test_non_utf8_line_is_a_counted_skip(tmp_path, tiny_llama_dir, capsys):
    lines = [json.dumps(_row(0)).encode(),
             json.dumps(_row(1, "caf\u00e9")).encode().replace(b"caf\\u00e9", b"caf\xe9"),  # Latin-1 byte
             json.dumps(_row(2)).encode()]
    source = tmp_path / "rows.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    assert main([str(_recipe_file(tmp_path, tiny_llama_dir, source))]) == 0
    out = capsys.readouterr().out
    skipped = json.loads((tmp_path / "runs/default/prepared/skipped.json").read_text())
    assert skipped["counts"] == {NOT_UTF8: 1} and skipped["total"] == 1
    example = skipped["examples"][NOT_UTF8][0]
    assert example["id"] == "rows.jsonl:2" and "0xe9" in example["detail"]
    assert "1 not UTF-8" in out
    assert sorted(load_prepared(tmp_path / "runs/default", "train")["id"]) == ["r0", "r2"]


def test_bom_does_not_cost_the_first_row(tmp_path):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + b"\n".join(json.dumps(_row(i)).encode() for i in range(3)) + b"\n")
    rows, skips = load_rows(str(jsonl))
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"] and skips.total == 0
    document = tmp_path / "bom.json"
    document.write_bytes(b"\xef\xbb\xbf" + json.dumps([_row(i) for i in range(2)]).encode())
    rows, skips = load_rows(str(document))
    assert [r["id"] for r in rows] == ["r0", "r1"] and skips.total == 0


@pytest.mark.parametrize("name,payload,fragment", [
    ("data.jsonl", bytes(range(256)) * 4, "is binary (NUL byte at offset 0)"),
    ("data.json", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is binary (NUL byte at offset 8)"),
    ("data.json", json.dumps([_row(0)]).encode().replace(b"Hi", b"H\xff"), "is not UTF-8 text (byte 0xff"),
])
def test_binary_or_non_utf8_data_file_is_one_error_line(tmp_path, name, payload, fragment):
    path = tmp_path / name
    path.write_bytes(payload)
    with pytest.raises(EyasError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as caught:
        load_rows(str(path))
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_lone_surrogate_is_a_counted_skip(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(1)).replace("Hi there!", "Hi \\ud800") + "\n")
    rows, skips = load_rows(str(path))
    assert [r["id"] for r in rows] == ["r0"] and skips.counts == {"malformed row": 1}
    assert "surrogate" in skips.examples["malformed row"][0]["detail"]


@pytest.mark.parametrize("payload,fragment", [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(200), "is a binary file (NUL byte at offset 7)"),
    (b"train:\n  lr: 1e-3  # d\xe9j\xe0 vu\n", "is not UTF-8 text (byte 0xe9 on line 2)"),
])
def test_binary_recipe_file_is_one_error_line(tmp_path, payload, fragment):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(payload)
    with pytest.raises(EyasError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(path)
    proc = subprocess.run([sys.executable, "-m", "eyas.cli", "prepare", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eyas: error: recipe file '{path}'")


def test_recipe_with_bom_loads(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbftrain:\n  lr: 0.002\n")
    assert load_recipe(path).train.lr == 0.002


def test_truncated_rows_are_counted(tmp_path, tiny_llama_dir, capsys):
    rows = [_row(0), _row(1, "word " * 200), _row(2, "more " * 150)]
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recipe = load_recipe(None, [f"target.path={tiny_llama_dir}", f"data.source={source}", "data.heldout_fraction=0.0",
                                f"run.output_dir={tmp_path}/runs", "data.max_length=120", "data.overflow=truncate"])
    info = prepare(recipe)
    assert info["truncated"] == 2 and info["skipped"] == {}
    skipped = json.loads((recipe.run_dir / "prepared" / "skipped.json").read_text())
    assert skipped["truncated"] == 2 and skipped["total"] == 0
    assert sorted(e["id"] for e in skipped["truncated_examples"]) == ["r1", "r2"]
    assert "cut to 120" in skipped["truncated_examples"][0]["detail"]
    from eyas.data.prepare import _report

    _report(info, recipe.run_dir / "prepared")
    assert "cut 2 rows longer than data.max_length" in capsys.readouterr().out
