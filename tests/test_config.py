"""Recipe loading: defaults, overrides, and every class of user error names the key."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eyas.config import (
    Recipe,
    apply_overrides,
    check_against_target,
    default_layers,
    load_recipe,
    parse_loss_mix,
    reference_markdown,
    save_resolved,
)
from eyas.errors import EyasError

RECIPES = Path(__file__).parent.parent / "recipes"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def test_defaults_and_values(tmp_path):
    r = load_recipe(write(tmp_path, "run: {name: r1}\ntrain: {lr: 3.0e-4, ttt_steps: 5}\ndraft: {kind: mtp}\n"))
    assert r.run.name == "r1" and r.train.lr == 3e-4 and r.train.ttt_steps == 5 and r.draft.kind == "mtp"
    assert r.train.ttt_decay == 0.8 and r.target.path == "smollm2-135m-instruct"  # defaults kept
    assert r.run_dir == Path("runs") / "r1"


def test_empty_file_and_no_file_give_defaults(tmp_path):
    assert load_recipe(write(tmp_path, "")) == Recipe()
    assert load_recipe(None) == Recipe()


def test_overrides_parse_yaml_values(tmp_path):
    r = load_recipe(write(tmp_path, "train: {lr: 1.0e-4}\n"),
                    ["train.lr=3e-4", "draft.kind=mtp", "train.ttt_steps=3", "dump.layers=[1,2,3]",
                     "data.regenerate=true", "run.name=abc"])
    assert r.train.lr == pytest.approx(3e-4) and isinstance(r.train.lr, float)
    assert r.draft.kind == "mtp" and r.train.ttt_steps == 3 and r.dump.layers == [1, 2, 3]
    assert r.data.regenerate is True and r.run.name == "abc"


def test_override_into_absent_section():
    raw = apply_overrides({}, ["eval.temperature=1"])
    assert raw == {"eval": {"temperature": 1}}


@pytest.mark.parametrize("text, overrides, fragment", [
    ("train: {lr: 1.0e-4, ttt_step: 3}\n", [], "did you mean 'ttt_steps'"),
    ("trian: {lr: 1.0e-4}\n", [], "did you mean 'train'"),
    ("", ["train.lrr=1"], "unknown recipe key 'train.lrr'"),
    ("train: {lr: -1.0}\n", [], "'train.lr' must be > 0"),
    ("train: {ttt_steps: 0}\n", [], "'train.ttt_steps' must be > 0"),
    ("train: {ttt_steps: 2.5}\n", [], "'train.ttt_steps' must be int"),
    ("train: {lr: fast}\n", [], "'train.lr' must be float"),
    ("draft: {kind: medusa}\n", [], "'draft.kind' is 'medusa'; choose one of: eagle, eagle3, mtp"),
    ("train: {loss: kl}\n", [], "unknown loss 'kl'"),
    ("data: {heldout_fraction: 1.5}\n", [], "'data.heldout_fraction' must be in [0.0, 1.0)"),
    ("dump: {layers: [1, 2]}\n", [], "takes 3 layer indices"),
    ("train: [1, 2]\n", [], "section 'train' must be a mapping"),
    ("", ["trainlr=1"], "must look like section.key=value"),
    ("run: {name: a/b}\n", [], "'run.name' must be a non-empty name"),
])
def test_errors_name_the_key(tmp_path, text, overrides, fragment):
    with pytest.raises(EyasError) as err:
        load_recipe(write(tmp_path, text), overrides)
    assert fragment in str(err.value)


def test_missing_and_non_yaml_files(tmp_path):
    with pytest.raises(EyasError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(EyasError, match="not valid YAML at line"):
        load_recipe(write(tmp_path, "run:\n  name: [unclosed\n"))
    with pytest.raises(EyasError, match="must be a YAML mapping"):
        load_recipe(write(tmp_path, "- just\n- a list\n"))


def test_layer_index_past_target_depth():
    target = SimpleNamespace(num_hidden_layers=30)
    ok = load_recipe(None, ["dump.layers=[2,15,27]"])
    check_against_target(ok, target)
    bad = load_recipe(None, ["dump.layers=[2,15,31]"])
    with pytest.raises(EyasError, match=r"index 31, but the target has 30 layers.*\[2, 15, 27\]"):
        check_against_target(bad, target)
    assert default_layers(30) == [2, 15, 27]


def test_mtp_ttt_longer_than_its_layers_is_refused():
    r = load_recipe(None, ["draft.kind=mtp", "draft.num_steps=3", "train.ttt_steps=5"])
    with pytest.raises(EyasError, match="train.ttt_steps <= draft.num_steps"):
        check_against_target(r, SimpleNamespace(num_hidden_layers=6))


def test_mtp_layers_past_the_unroll_are_refused():
    """A 5-layer mtp draft unrolled 3 deep would serve layers 4-5 untrained."""
    r = load_recipe(None, ["draft.kind=mtp", "draft.num_steps=5", "train.ttt_steps=3"])
    with pytest.raises(EyasError, match=r"layers 4-5 would get no gradient.*train.ttt_steps=5"):
        check_against_target(r, SimpleNamespace(num_hidden_layers=6))
    check_against_target(load_recipe(None, ["draft.kind=mtp", "draft.num_steps=5", "train.ttt_steps=5"]),
                         SimpleNamespace(num_hidden_layers=6))


def test_loss_mix():
    assert parse_loss_mix("forward_kl") == {"forward_kl": 1.0}
    assert parse_loss_mix("forward_kl:0.9, ce:0.1") == {"forward_kl": 0.9, "ce": 0.1}
    with pytest.raises(EyasError, match="not a number"):
        parse_loss_mix("ce:x")


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(None, ["train.lr=2e-4", "run.name=x"])
    out = save_resolved(r, tmp_path / "run")
    again = load_recipe(out)
    assert again == r
    assert set(yaml.safe_load(out.read_text())) == {"run", "target", "data", "dump", "draft", "train", "eval", "export"}


def test_yaml_words_no_on_off_stay_strings(tmp_path):
    r = load_recipe(write(tmp_path, "train: {mixed_precision: no, resume: false}\n"), ["data.regenerate=true"])
    assert r.train.mixed_precision == "no" and r.train.resume is False and r.data.regenerate is True


def test_docs_key_reference_is_current():
    """docs/recipes.md documents every recipe key, exactly as eyas/config.py defines it."""
    doc = (Path(__file__).parent.parent / "docs" / "recipes.md").read_text()
    start, end = doc.index("<!-- KEYS -->\n") + len("<!-- KEYS -->\n"), doc.index("\n<!-- /KEYS -->")
    table = doc[start:end]
    documented = set(re.findall(r"^\| `(\w+\.\w+)` \|", table, flags=re.MULTILINE))
    keys = {f"{section}.{key}" for section, values in Recipe().to_dict().items() for key in values}
    assert documented == keys, (f"docs/recipes.md lacks {sorted(keys - documented)}, "
                                f"documents unknown {sorted(documented - keys)}")
    assert table == reference_markdown(), "regenerate the docs/recipes.md table with eyas.config.reference_markdown()"
