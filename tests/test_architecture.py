"""The package's floors, read off the folders and checked on the import graph (AST), lazy imports included.

Three floors, each a set of folders. At the bottom, the shared library, `eyas/` (recipes, targets, draft
kinds, decoding, errors, io, the stage table and the stage record a stage checks before it runs): it imports
nothing above it. In the middle, the stages, where data flows one way: `data/` -> `train/` -> `eval/` (as
`eyas.data`, `eyas.train`, `eyas.eval`). A stage imports the library and the stages before it, never a later
one. On top, the front door: `cli/` (the `eyas` command, its command table, the quickstart, `eyas plan`, the
launcher) and `slurm/` (submission): the only floor that imports several stages, and nothing imports it.
The floors are folders, so no module is listed by hand. An `eyas.*` import inside a function needs a one-line
reason on the line above or beside it (a comment), so every file's header says what it depends on.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from eyas.draft.registry import KINDS, head_class
from eyas.recipe_schema import CHOICES, DraftConfig

ROOT = Path(__file__).resolve().parents[1]
# Each folder's package and floor: 0 the library, 1-3 the stages in pipeline order, 4 the front door.
FOLDERS = {"eyas": ("eyas", 0), "data": ("eyas.data", 1), "train": ("eyas.train", 2), "eval": ("eyas.eval", 3),
           "cli": ("eyas.cli", 4), "slurm": ("eyas.slurm", 4)}
FRONT = 4


def _modules() -> list[tuple[str, Path]]:
    found = []
    for folder, (package, _) in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = (package, *path.relative_to(ROOT / folder).with_suffix("").parts)
            found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def _floor(module: str) -> int | None:
    """The floor of an `eyas.*` module: its folder's, the longest package that holds it (None: not eyas)."""
    packages = sorted(FOLDERS.values(), key=lambda p: -len(p[0]))
    return next((floor for package, floor in packages if module == package or module.startswith(package + ".")), None)


def _eyas_imports(tree: ast.AST) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported module, inside a function) for every `eyas.*` import, `from eyas import x` as `eyas.x`."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "eyas":
                if child.module == "eyas":  # `from eyas import cli` names the module eyas.cli
                    out.extend((child, f"eyas.{a.name}", in_function) for a in child.names)
                else:
                    out.append((child, child.module, in_function))
            elif isinstance(child, ast.Import):
                out.extend((child, a.name, in_function) for a in child.names if a.name.split(".")[0] == "eyas")
            visit(child, nested)

    visit(tree, False)
    return out


def _wrong_imports(name: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what is wrong) for every import of `name`'s module that runs against the floors."""
    mine = _floor(name)
    wrong = []
    for node, imported, _ in _eyas_imports(tree):
        theirs = _floor(imported)
        if theirs is None or mine == FRONT or theirs == 0:
            continue
        if mine == 0:
            wrong.append((node.lineno, f"the library module {name} imports {imported}, a floor above it"))
        elif theirs == FRONT:
            wrong.append((node.lineno, f"the stage module {name} imports the front door's {imported}"))
        elif theirs > mine:
            wrong.append((node.lineno, f"{name} imports the later stage {imported}"))
    return wrong


def test_every_import_keeps_to_the_floors():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {why}" for name, path in _modules()
             for line, why in _wrong_imports(name, ast.parse(path.read_text()))]
    assert not wrong, "imports against the floors:\n" + "\n".join(wrong)


def test_every_folder_is_on_a_floor():
    """A new top-level folder of Python code is given its floor here, or the rule would not see it."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {folder: package for package, folder in mapped.items() if folder != "recipes"} == \
        {folder: package for folder, (package, _) in FOLDERS.items()}


def test_function_local_eyas_imports_say_why():
    bare = []
    for _, path in _modules():
        lines = path.read_text().splitlines()
        for node, imported, in_function in _eyas_imports(ast.parse("\n".join(lines))):
            if not in_function:
                continue
            here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: {imported}")
    assert not bare, "function-local eyas imports without a stated reason:\n" + "\n".join(bare)


@pytest.mark.parametrize(("module", "source", "found"), [
    ("eyas.data.dump", "def f():\n    from eyas.eval.kv import tree_mask\n", "later stage eyas.eval.kv"),
    ("eyas.train.loop", "from eyas.cli import plan\n", "front door's eyas.cli"),
    ("eyas.eval.cli", "import eyas.cli.main\n", "front door's eyas.cli.main"),
    ("eyas.config", "def f():\n    from eyas.train.loop import train\n", "library module eyas.config imports"),
    ("eyas.stages", "from eyas import cli\n", "library module eyas.stages imports eyas.cli"),
])
def test_the_rule_catches_an_import_against_the_floors(module, source, found):
    """The checker itself: a later stage, the front door or a library module reaching up, inside a function too."""
    [(_, why)] = _wrong_imports(module, ast.parse(source))
    assert found in why


def test_the_rule_lets_the_floors_import_down():
    source = "from eyas.config import Recipe\nfrom eyas.data.dump import dump\ndef f():\n    import eyas.eval.kv\n"
    assert _wrong_imports("eyas.eval.cli", ast.parse(source)) == []
    assert _wrong_imports("eyas.cli.plan", ast.parse(source)) == []


def test_recipe_kinds_are_the_registry():
    """`draft.kind` accepts exactly the kinds the registry builds."""
    assert set(CHOICES["draft.kind"]) == set(KINDS)
    assert DraftConfig().kind in KINDS


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_declares_its_contract(kind):
    """A kind's file declares its layout (the one its registry line names for the torch-free recipe checks) and what
    the stages ask of it, so no stage probes a head (or a draft adapter) for an attribute."""
    cls = head_class(kind)
    assert cls.kind == kind
    assert cls.__module__ == f"eyas.draft.{kind}" and (ROOT / "eyas" / "draft" / f"{kind}.py").is_file(), "one file per kind"
    assert "layout" in cls.__dict__ and cls.layout is KINDS[kind].layout, "the kind's class declares its registry line's layout"
    assert cls.feature in ("aux_hidden", "last_hidden")
    assert cls.default_token_feed in ("draft", "data")
    if cls.layout.name == "block":
        assert cls.first_predicting_row in (0, 1) and isinstance(cls.gives_confidence, bool)
