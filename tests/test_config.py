"""Recipe loading: defaults, overrides, and every class of user error names the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eyas.config import absolute_paths, apply_overrides, load_recipe, save_resolved
from eyas.draft.features import default_layers
from eyas.errors import EyasError
from eyas.recipe_checks import check_against_target, parse_loss_mix
from eyas.recipe_docs import recipe_keys, reference_markdown
from eyas.recipe_schema import Recipe
from eyas.stage_cli import stage_main

RECIPES = Path(__file__).parent.parent / "recipes"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def test_defaults_and_values(tmp_path):
    r = load_recipe(write(tmp_path, "run: {name: r1}\ntrain: {lr: 3.0e-4, ttt_steps: 5}\ndraft: {kind: mtp, num_steps: 5}\n"))
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
    ("run: {name: '..'}\n", [], "'run.name' must be a non-empty name"),  # runs/.. is not a run directory
])
def test_errors_name_the_key(tmp_path, text, overrides, fragment):
    with pytest.raises(EyasError) as err:
        load_recipe(write(tmp_path, text), overrides)
    assert fragment in str(err.value)


def test_a_number_in_exponent_form_is_a_float(tmp_path):
    """PyYAML reads `3e-4` (no dot) as text; a float key takes it as the number it is, text stays refused."""
    recipe = load_recipe(write(tmp_path, "train: {lr: 3e-4, weight_decay: 1E-2}\n"))
    assert (recipe.train.lr, recipe.train.weight_decay) == (3e-4, 1e-2)
    with pytest.raises(EyasError, match="'train.lr' must be float, got str '3e-4x'"):
        load_recipe(write(tmp_path, "train: {lr: 3e-4x}\n"))
    with pytest.raises(EyasError, match="'train.ttt_steps' must be int"):
        load_recipe(write(tmp_path, "train: {ttt_steps: 3e0}\n"))


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


def test_mtp_unroll_follows_its_layers_unless_given():
    """mtp's train.ttt_steps defaults to draft.num_steps (one step per layer), from a file and from overrides."""
    assert load_recipe(None, ["draft.kind=mtp", "draft.num_steps=3"]).train.ttt_steps == 3
    assert load_recipe(None, ["draft.kind=mtp", "draft.num_steps=6"]).train.ttt_steps == 6
    assert load_recipe(None, ["draft.kind=eagle3", "draft.num_steps=3"]).train.ttt_steps == Recipe().train.ttt_steps
    assert load_recipe(None, ["draft.kind=mtp", "draft.num_steps=4", "train.ttt_steps=4"]).train.ttt_steps == 4


def test_mtp_ttt_longer_than_its_layers_is_refused_at_load(tmp_path):
    """Refused when the recipe is loaded (what `eyas prepare` does first), in one line naming both keys."""
    with pytest.raises(EyasError, match="train.ttt_steps <= draft.num_steps") as err:
        load_recipe(write(tmp_path, f"run: {{output_dir: '{tmp_path / 'runs'}'}}\ndraft: {{kind: mtp, num_steps: 3}}\n"
                                    "train: {ttt_steps: 5}\n"))
    assert "\n" not in str(err.value) and "'train.ttt_steps' is 5" in str(err.value)
    assert stage_main("prepare", [str(tmp_path / "recipe.yaml")], lambda r, a: pytest.fail("prepare ran")) == 2
    assert not (tmp_path / "runs").exists()  # nothing written, not even the run's recipe.yaml


def test_mtp_layers_past_the_unroll_are_refused():
    """A 5-layer mtp draft unrolled 3 deep would serve layers 4-5 untrained: refused at load, and by
    check_against_target for a recipe changed after loading."""
    with pytest.raises(EyasError, match=r"layers 4-5 would get no gradient.*train.ttt_steps=5"):
        load_recipe(None, ["draft.kind=mtp", "draft.num_steps=5", "train.ttt_steps=3"])
    r = load_recipe(None, ["draft.kind=mtp", "draft.num_steps=5", "train.ttt_steps=5"])
    check_against_target(r, SimpleNamespace(num_hidden_layers=6))
    changed = dataclasses.replace(r, train=dataclasses.replace(r.train, ttt_steps=3))
    with pytest.raises(EyasError, match="layers 4-5 would get no gradient"):
        check_against_target(changed, SimpleNamespace(num_hidden_layers=6))


def test_loss_mix():
    assert parse_loss_mix("forward_kl") == {"forward_kl": 1.0}
    assert parse_loss_mix("forward_kl:0.9, ce:0.1") == {"forward_kl": 0.9, "ce": 0.1}
    with pytest.raises(EyasError, match="not a number"):
        parse_loss_mix("ce:x")


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(None, ["train.lr=2e-4", "run.name=x"])
    out = save_resolved(r, tmp_path / "run")
    again = load_recipe(out)
    assert again == absolute_paths(r) and again.run.output_dir == str(Path.cwd() / "runs")
    assert set(yaml.safe_load(out.read_text())) == {"run", "target", "data", "dump", "draft", "train", "eval", "export"}


def test_yaml_words_no_on_off_stay_strings(tmp_path):
    r = load_recipe(write(tmp_path, "train: {mixed_precision: no, resume: false}\n"), ["data.regenerate=true"])
    assert r.train.mixed_precision == "no" and r.train.resume is False and r.data.regenerate is True


def test_docs_key_reference_is_current():
    """docs/recipes.md documents every recipe key, exactly as eyas/recipe_schema.py defines it."""
    doc = (Path(__file__).parent.parent / "docs" / "recipes.md").read_text()
    start, end = doc.index("<!-- KEYS -->\n") + len("<!-- KEYS -->\n"), doc.index("\n<!-- /KEYS -->")
    table = doc[start:end]
    documented = set(re.findall(r"^\| `(\w+\.\w+)` \|", table, flags=re.MULTILINE))
    keys = set(recipe_keys())  # every section's keys and every kind's own
    assert documented == keys, (f"docs/recipes.md lacks {sorted(keys - documented)}, "
                                f"documents unknown {sorted(documented - keys)}")
    assert table == reference_markdown(), "regenerate the docs/recipes.md table with eyas.recipe_docs.reference_markdown()"


def test_saved_recipe_names_the_same_files_from_another_folder(tmp_path, monkeypatch):
    """A run's recipe with relative paths, saved by a stage as <run_dir>/recipe.yaml, then passed to a stage
    from another working directory: the same run directory, target, data, template and prompt files."""
    project, elsewhere = tmp_path.resolve() / "project", tmp_path.resolve() / "elsewhere"  # getcwd() is resolved
    for folder in (project / "models" / "tiny", project / "data", elsewhere):
        folder.mkdir(parents=True)
    for name in ("data/rows.jsonl", "data/template.jinja", "data/prompts.jsonl"):
        (project / name).write_text("{}\n")
    (project / "recipe.yaml").write_text(
        "run: {name: rel, output_dir: runs}\ntarget: {path: models/tiny, chat_template: data/template.jinja}\n"
        "data: {source: data/rows.jsonl}\neval: {prompts: data/prompts.jsonl, drafts: [ckpt/a, 'truncated:2']}\n"
        "train: {trust_checkpoint: runs/old/checkpoints/step_00000010}\n")
    monkeypatch.chdir(project)
    seen = []
    assert stage_main("prepare", ["recipe.yaml"], lambda recipe, args: seen.append(recipe)) == 0
    original = seen[0]
    assert original.run.output_dir == "runs"  # the loaded recipe keeps what the user wrote

    monkeypatch.chdir(elsewhere)
    saved = load_recipe(project / "runs" / "rel" / "recipe.yaml")
    assert saved.run_dir == project / "runs" / "rel"
    assert Path(saved.target.path) == project / "models" / "tiny" and Path(saved.target.path).is_dir()
    assert Path(saved.data.source) == project / "data" / "rows.jsonl" and Path(saved.data.source).is_file()
    assert Path(saved.target.chat_template) == project / "data" / "template.jinja"
    assert Path(saved.eval.prompts) == project / "data" / "prompts.jsonl"
    assert saved.eval.drafts == [str(project / "ckpt" / "a"), "truncated:2"]
    assert Path(saved.train.trust_checkpoint) == project / "runs" / "old" / "checkpoints" / "step_00000010"
    # words that are not paths stay words; saving the saved copy again changes nothing
    assert load_recipe(None, ["data.source=chitchat", "eval.prompts=heldout"]).data.source == "chitchat"
    kept = absolute_paths(load_recipe(None, ["data.source=chitchat", "eval.prompts=heldout", "target.path=~/m"]))
    assert (kept.data.source, kept.eval.prompts, kept.target.path, kept.eval.output) == ("chitchat", "heldout", "~/m", "")
    assert load_recipe(save_resolved(saved, tmp_path / "again")) == saved
