"""The package's layering, checked on the source (AST), so it holds after every change.

Three layers. On top, the front door (`FRONT_DOOR`: the `eyas` command and its dispatch, the command
table, `eyas plan`, the quickstart, the launcher, SLURM submission), which runs and plans the stages.
In the middle, the stages, where data flows one way: `eyas.data` -> `eyas.train` -> `eyas.eval`. A
stage may import the shared modules in `eyas/` and the stages before it, never a later one, and never
the front door (a package's `__main__.py`, its `python -m` entry through the dispatcher, aside). At
the bottom, the shared modules in `eyas/`, which import no stage. An `eyas.*` import inside a function
needs a one-line reason on the line above or beside it (a comment), so every file's header says what it
depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eyas.config import CHOICES, DraftConfig
from eyas.draft.registry import KINDS, head_class

ROOT = Path(__file__).resolve().parents[1]
STAGE_DIRS = {"data": "eyas.data", "train": "eyas.train", "eval": "eyas.eval", "slurm": "eyas.slurm"}
ORDER = {"eyas.data": 0, "eyas.train": 1, "eyas.eval": 2}
# The top layer: it imports the stages; no stage imports it.
FRONT_DOOR = {"eyas.cli", "eyas.__main__", "eyas.pipeline", "eyas.plan", "eyas.quickstart", "eyas.launch",
              "eyas.slurm.submit"}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in STAGE_DIRS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            found.append((package if path.stem == "__init__" else f"{package}.{path.stem}", path))
    for path in sorted((ROOT / "eyas").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append((name, path))
    return found


def _eyas_imports(tree: ast.AST) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported module, inside a function) for every `eyas.*` import."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("eyas"):
                out.append((child, child.module, in_function))
            elif isinstance(child, ast.Import):
                out.extend((child, a.name, in_function) for a in child.names if a.name.startswith("eyas"))
            visit(child, nested)

    visit(tree, False)
    return out


def _stage(module: str) -> str | None:
    return next((s for s in ORDER if module == s or module.startswith(s + ".")), None)


def test_data_flows_one_way():
    wrong = []
    for name, path in _modules():
        if name.startswith("eyas.slurm") or name in FRONT_DOOR:
            continue
        mine = _stage(name)
        for node, imported, _ in _eyas_imports(ast.parse(path.read_text())):
            theirs = _stage(imported)
            if theirs is None:
                continue
            if mine is None:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: shared module {name} imports stage {imported}")
            elif ORDER[theirs] > ORDER[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} imports the later stage {imported}")
    assert not wrong, "imports against the pipeline's direction:\n" + "\n".join(wrong)


def _front_door_imports(node: ast.AST, imported: str) -> list[str]:
    """The front-door modules an import names: `from eyas import plan` names `eyas.plan`."""
    names = [imported] + ([f"{imported}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [])
    return [n for n in names if n in FRONT_DOOR]


def test_no_stage_imports_the_front_door():
    """The front door runs and plans the stages; a stage importing it back (even inside a function) would tie
    the layers both ways. Each stage's `__main__.py` dispatches through the CLI, which is its job."""
    wrong = []
    for name, path in _modules():
        if _stage(name) is None or path.name == "__main__.py":
            continue
        for node, imported, _ in _eyas_imports(ast.parse(path.read_text())):
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}: {name} imports {door}"
                      for door in _front_door_imports(node, imported)]
    assert not wrong, "stage modules importing the front door:\n" + "\n".join(wrong)


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


def test_the_rule_catches_a_backward_import(tmp_path):
    """The checker itself: a data module importing eval is reported."""
    tree = ast.parse("def f():\n    from eyas.eval.kv import tree_mask\n")
    [(node, imported, in_function)] = _eyas_imports(tree)
    assert imported == "eyas.eval.kv" and in_function and ORDER[_stage(imported)] > ORDER["eyas.data"]


def test_the_rule_catches_a_front_door_import():
    """The checker itself: the front door named as a module or from its package, inside a function too."""
    tree = ast.parse("from eyas import config, plan\nimport eyas.launch\ndef f():\n    from eyas.cli import main\n")
    found = [_front_door_imports(node, imported) for node, imported, _ in _eyas_imports(tree)]
    assert found == [["eyas.plan"], ["eyas.launch"], ["eyas.cli"]]


def test_recipe_kinds_are_the_registry():
    """`draft.kind` accepts exactly the kinds the registry builds."""
    assert set(CHOICES["draft.kind"]) == set(KINDS)
    assert DraftConfig().kind in KINDS


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_declares_its_contract(kind):
    cls = head_class(kind)
    assert cls.kind == kind
    assert cls.feature in ("aux_hidden", "last_hidden")
    assert cls.default_token_feed in ("draft", "data")
    assert (ROOT / "eyas" / "draft" / f"{kind}.py").is_file(), "one file per kind"
