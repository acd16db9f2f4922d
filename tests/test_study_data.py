"""The study data kept in the repository (benchmarks/study_data.py): a committed set restores to the prepared data
its manifest describes, current for its recipe so a study starts at the dump; a damaged byte is refused."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from eyas import stages
from eyas.config import load_recipe
from eyas.data.prepare import load_prepared, split_stats

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _study_data():
    spec = importlib.util.spec_from_file_location("study_data", BENCH / "study_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(p.stem for p in (BENCH / "data").glob("*.json")))
def test_a_committed_set_restores_to_its_manifest_and_is_current_for_its_recipe(tmp_path, name):
    study_data = _study_data()
    manifest = study_data.load_manifest(name)
    run = tmp_path / "restored-here"  # not the folder the set was prepared in: the restored recipe names this one
    study_data.restore(name, run)
    recipe = load_recipe(run / "recipe.yaml")
    assert recipe.run_dir == run  # so `eyas dump run/recipe.yaml` reads these prepared files and writes beside them
    assert stages.check("prepare", recipe).current  # `eyas prepare` would do nothing: the dump reads it as is
    for split, sizes in manifest["splits"].items():
        assert split_stats(load_prepared(run, split)) == sizes
    with pytest.raises(SystemExit, match="exists; restore into a new run folder"):
        study_data.restore(name, run)


def test_a_damaged_archive_is_refused(tmp_path):
    study_data = _study_data()
    name = sorted(p.stem for p in (BENCH / "data").glob("*.json"))[0]
    for suffix in (".json", ".tar.xz"):
        shutil.copy(BENCH / "data" / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    archive = tmp_path / f"{name}.tar.xz"
    blob = bytearray(archive.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    archive.write_bytes(bytes(blob))
    with pytest.raises(SystemExit, match="does not match its manifest's sha256"):
        study_data.restore(name, tmp_path / "run", data=tmp_path)
    assert not (tmp_path / "run").exists()
