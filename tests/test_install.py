"""The wheel is what it says: it carries every source file, and eyas runs from it alone.

The README's editable install maps the work tree into `eyas.*`, which hides a package that
`pyproject.toml` forgets (a wheel once shipped without `eyas.draft`). These tests build the
wheel the way `pip install .`, a Docker image or a vLLM environment would, compare its files
with the tracked source tree, and import every module and entry point from an installed copy
of it with the editable finder taken out of the import system.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, str]:
    """pyproject's package -> source folder mapping (`eyas.data` -> `data`)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def expected_wheel_files() -> set[str]:
    """Every tracked file under a mapped source folder, named as the wheel names it."""
    names = set()
    for pkg, src in package_dirs().items():
        tracked = subprocess.run(["git", "ls-files", src], cwd=ROOT, capture_output=True, text=True, check=True)
        names.update(pkg.replace(".", "/") + path[len(src):] for path in tracked.stdout.split())
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tracked files only: a stale build/ folder in the work tree would
    otherwise fill in a package that pyproject leaves out."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for path in tracked:
        if (ROOT / path).is_file():
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True)
    (built,) = out.glob("eyas-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    return target


def test_every_package_is_listed_in_pyproject():
    """Each folder with an __init__.py under a mapped source folder is a package the wheel lists."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for pkg, src in package_dirs().items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src)
            if "__pycache__" not in rel.parts:
                found.add(".".join([pkg, *rel.parts]))
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"


def test_wheel_holds_exactly_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if ".dist-info/" not in n}
    expected = expected_wheel_files()
    assert expected - shipped == set(), f"tracked files missing from the wheel: {sorted(expected - shipped)}"
    assert shipped - expected == set(), f"files in the wheel that are not tracked source: {sorted(shipped - expected)}"


# Run in a fresh interpreter outside the work tree: drops the editable finder, imports every module
# of the installed copy and checks it came from there, then loads the entry points the wheel declares.
_IMPORT_ALL = r"""
import importlib, importlib.metadata as md, json, pkgutil, sys
target = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, target)
import eyas
modules = [m.name for m in pkgutil.walk_packages(eyas.__path__, "eyas.") if not m.name.endswith("__main__")]
outside = {}
for name in modules:
    module = importlib.import_module(name)
    if not str(getattr(module, "__file__", "")).startswith(target):
        outside[name] = module.__file__
(dist,) = [d for d in md.distributions(path=[target]) if d.metadata["Name"] == "eyas"]
points = {f"{ep.group}:{ep.name}": callable(ep.load()) for ep in dist.entry_points}
print(json.dumps({"modules": modules, "outside": outside, "entry_points": points}))
"""


def test_installed_wheel_imports_every_module_and_entry_point(installed, tmp_path):
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(installed)], cwd=tmp_path, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TRANSFORMERS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {p.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
                for p in expected_wheel_files() if p.endswith(".py") and not p.endswith("__main__.py")}
    assert set(report["modules"]) | {"eyas"} == expected
    assert report["outside"] == {}, f"modules imported from outside the installed wheel: {report['outside']}"
    assert report["entry_points"] == {"console_scripts:eyas": True, "vllm.general_plugins:eyas_mtp": True}


def declared_floors() -> dict[str, str]:
    """pyproject's `name>=X` floors of the core dependencies (torch apart: CI pins the one build it has)."""
    floors = {}
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, _, rest = requirement.partition(">=")
        assert rest, f"dependency {requirement!r} has no >= floor: declare the lowest tested version"
        floors[name.strip().lower()] = rest.split(",")[0].strip()
    floors.pop("torch")
    return floors


def test_floors_run_is_pinned_to_exactly_the_declared_floors():
    """.ci/lowest.txt (what the floors run installs) names every declared floor and nothing else."""
    pins = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    assert pins == declared_floors()
