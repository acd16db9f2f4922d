"""Head kinds as plugins: every kind's export (names, shapes, dtypes, config.json, marker) and its
refusals are exactly the ones recorded in `tests/data/draft_plugins_export.json`, which was written
by the exporter before each kind's mapping moved into its own module (eyas/draft/<kind>.py); the
feature a kind's dump writes is the one its trainer accepts; and a new kind plugs into export, the
shard check and the recipe rules from its own declarations alone (no driver names it).

Regenerate the golden file only for an intended format change:
    python tests/test_draft_plugins.py --write
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas.config import from_dict
from eyas.data.dump import feature_spec, manifest_features
from eyas.draft import kinds, registry
from eyas.draft.checkpoint import save_draft
from eyas.draft.eagle import EagleHead
from eyas.draft.features import FeatureSpec
from eyas.draft.formats import FormatSpec, KindExport, attention_shapes, llama_config, mlp_shapes
from eyas.draft.layouts import LAYER_PER_STEP, LAYOUTS
from eyas.draft.registry import KINDS, Kind, build_head, head_class
from eyas.errors import EyasError
from eyas.recipe_kinds import check_mtp_unroll, draft_config
from eyas.recipe_schema import DraftConfig, Recipe
from eyas.train import export
from eyas.train.data import check_shards_fit

GOLDEN = Path(__file__).parent / "data" / "draft_plugins_export.json"
DRAFT_VOCAB = 100

# name: (target family, target overrides, kind, draft kwargs, reduced vocab, aux layers, format, steps,
#        pass the target path, config.json edits)
CASES: dict[str, tuple] = {
    "eagle3-sglang": ("llama", {}, "eagle3", {}, True, [2, 3, 4], "sglang", 0, False, {}),
    "eagle3-vllm": ("llama", {}, "eagle3", {}, True, [2, 3, 4], "vllm", 0, False, {}),
    "eagle3-sglang-target": ("llama", {}, "eagle3", {}, True, [2, 3, 4], "sglang", 4, True, {}),
    "eagle3-vllm-target": ("llama", {}, "eagle3", {}, True, [2, 3, 4], "vllm", 4, True, {}),
    "eagle3-fullvocab-sglang": ("llama", {}, "eagle3", {}, False, [1, 3, 5], "sglang", 0, False, {}),
    "eagle3-fullvocab-vllm": ("llama", {}, "eagle3", {}, False, [1, 3, 5], "vllm", 0, False, {}),
    "eagle3-nbfc-vllm": ("llama", {}, "eagle3", {"eagle3_norm_before_fc": True}, True, [2, 3, 4], "vllm", 0, False, {}),
    "eagle3-nbfc-sglang": ("llama", {}, "eagle3", {"eagle3_norm_before_fc": True}, True, [2, 3, 4], "sglang", 0, False, {}),
    "eagle3-nbr-vllm": ("llama", {}, "eagle3", {"eagle3_norm_before_residual": True}, True, [2, 3, 4], "vllm", 0,
                        False, {}),
    "eagle3-nbr-sglang": ("llama", {}, "eagle3", {"eagle3_norm_before_residual": True}, True, [2, 3, 4], "sglang", 0,
                          False, {}),
    "eagle3-both-vllm": ("llama", {}, "eagle3", {"eagle3_norm_before_fc": True, "eagle3_norm_before_residual": True},
                         True, [2, 3, 4], "vllm", 2, False, {}),
    "eagle3-bias-sglang": ("llama", {"attention_bias": True}, "eagle3", {}, True, [2, 3, 4], "sglang", 0, False, {}),
    "eagle3-qwen2-vllm": ("qwen2", {}, "eagle3", {}, True, [2, 3, 4], "vllm", 0, False, {}),
    "eagle3-aux-range": ("llama", {}, "eagle3", {}, True, [0, 3, 4], "sglang", 0, False, {}),
    "eagle3-mismatched-target": ("llama", {}, "eagle3", {}, True, [2, 3, 4], "vllm", 0, True,
                                 {"max_position_embeddings": 256}),
    "eagle-sglang": ("llama", {}, "eagle", {}, False, None, "sglang", 0, False, {}),
    "eagle-vllm": ("llama", {}, "eagle", {}, False, None, "vllm", 3, False, {}),
    "eagle-vllm-target": ("llama", {}, "eagle", {}, False, None, "vllm", 0, True, {}),
    "eagle-bias-sglang": ("llama", {"attention_bias": True}, "eagle", {}, False, None, "sglang", 0, False, {}),
    "eagle-bias-vllm": ("llama", {"attention_bias": True}, "eagle", {}, False, None, "vllm", 0, False, {}),
    "eagle-qwen2-sglang": ("qwen2", {}, "eagle", {}, False, None, "sglang", 0, False, {}),
    "mtp-sglang": ("llama", {}, "mtp", {"num_steps": 3}, False, None, "sglang", 0, False, {}),
    "mtp-sglang-feed": ("llama", {}, "mtp", {"num_steps": 2, "mtp_feed": "target"}, False, None, "sglang", 5, True, {}),
    "mtp-sglang-mimo": ("llama", {}, "mtp", {"num_steps": 2}, False, None, "sglang", 0, False,
                        {"target_model_type": "mimo_v2"}),
    "mtp-bias-sglang": ("llama", {"attention_bias": True}, "mtp", {"num_steps": 2}, False, None, "sglang", 0, False, {}),
    "mtp-vllm-untied": ("llama", {}, "mtp", {"num_steps": 3}, False, None, "vllm", 0, False, {}),
    "mtp-vllm": ("llama", {"tie_word_embeddings": True}, "mtp", {"num_steps": 4}, False, None, "vllm", 0, False, {}),
    "mtp-vllm-2": ("llama", {"tie_word_embeddings": True}, "mtp", {"num_steps": 3}, False, None, "vllm", 2, True, {}),
    "mtp-vllm-too-many": ("llama", {"tie_word_embeddings": True}, "mtp", {"num_steps": 3}, False, None, "vllm", 4,
                          False, {}),
    "mtp-draft-vocab": ("llama", {}, "mtp", {"num_steps": 2}, True, None, "sglang", 0, False, {}),
    "dspark-vllm": ("llama", {}, "dspark", {"num_steps": 4, "markov_rank": 8}, True, [2, 3, 4], "vllm", 0, True, {}),
    "dspark-vllm-too-many": ("llama", {}, "dspark", {"num_steps": 3}, False, [2, 3, 4], "vllm", 4, False, {}),
}


def _target_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5 if family == "llama" else 1e-6,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM"])
    base.update(overrides)
    return (LlamaConfig if family == "llama" else Qwen2Config)(**base)


def _export_case(name: str, root: Path) -> dict:
    """What exporting one case writes (or the one-line refusal), with the temporary root masked."""
    family, overrides, kind, draft, reduced, aux, fmt, steps, with_target, edits = CASES[name]
    config = _target_config(family, **overrides)
    target_dir = root / "target"
    if with_target:
        config.save_pretrained(target_dir)
    torch.manual_seed(0)
    d2t = torch.arange(0, config.vocab_size, 3)[:DRAFT_VOCAB] - torch.arange(DRAFT_VOCAB) if reduced else None
    head = build_head(draft_config(kind=kind, **draft), config, aux_layers=aux, d2t=d2t)
    ckpt = save_draft(root / "ckpt", head, {"ttt_steps": 4})
    if edits:
        saved = json.loads((ckpt / "config.json").read_text())
        saved.update(edits)
        (ckpt / "config.json").write_text(json.dumps(saved))
    try:
        out = export.export_draft(ckpt, fmt, root / fmt, dtype="bfloat16", speculative_tokens=steps,
                                  target_path=str(target_dir) if with_target else None)
    except EyasError as exc:
        return {"error": str(exc).replace(str(root), "<tmp>")}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in sorted(f.keys())}
    written = json.loads((out / "config.json").read_text())
    marker = json.loads((out / export.MARKER).read_text().replace(str(root), "<tmp>"))
    marker.pop("source")
    return {"tensors": tensors, "config": json.loads(json.dumps(written).replace(str(root), "<tmp>")),
            "marker": marker, "read_back": export.head_config_from_export(written)}


@pytest.mark.parametrize("name", list(CASES))
def test_every_kind_exports_as_recorded(tmp_path, name):
    """Names, shapes, dtypes, config.json, the marker and the read-back config are the recorded ones."""
    golden = json.loads(GOLDEN.read_text())
    assert _export_case(name, tmp_path) == golden[name]


# ----------------------------------------------------------------------------- every kind's declarations


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_declares_a_plugin(kind):
    """Recipe rules for every kind, the feature key is the spec's, and formats the export command offers."""
    cls = head_class(kind)
    assert isinstance(cls.rules, kinds.KindRules) and cls.rules.title
    assert cls.feature == cls.feature_spec.name
    assert set(cls.export.formats) <= set(export.FORMATS) and cls.export.formats
    assert "embed_tokens.weight" in cls.export.from_target


def test_every_layout_is_built_by_every_stage():
    """A kind's layout has its training scoring, its eval adapter and its batched adapter: a layout missing from
    one table would fail only when a run of that kind reached the stage."""
    from eyas.eval.batched import BATCHED
    from eyas.eval.head_draft import ADAPTERS
    from eyas.train.ttt import SCORING

    for table in (SCORING, ADAPTERS, BATCHED):
        assert set(table) == set(LAYOUTS)
    assert {head_class(kind).layout for kind in KINDS} == set(LAYOUTS)  # none is dead
    assert all(head_class(kind).layout is KINDS[kind].layout for kind in KINDS)


def test_architectures_name_one_kind_and_format():
    """An exported config.json is read back by its architecture and the format its `eyas` block records (both
    engines name DFlash's draft class the same): an architecture belongs to one kind, and with the format to
    one (kind, format)."""
    owners: dict[str, set] = {}
    for kind in KINDS:
        for fmt, spec in head_class(kind).export.formats.items():
            for architecture in (spec.architecture, *spec.aliases):
                owners.setdefault(architecture, set()).add(kind)
            assert export.exported_kind({"architectures": [spec.architecture], "eyas": {"format": fmt}}) == (kind, fmt)
    assert all(len(kinds_) == 1 for kinds_ in owners.values()), owners
    with pytest.raises(EyasError, match="architecture 'LlamaForCausalLM'.*eyas export"):
        export.exported_kind({"architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("teacher", ["last_hidden", "topk"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_dump_writes_what_the_trainer_checks(kind, teacher):
    """The manifest features the dump writes for a kind pass that kind's shard check; a kind reading
    another feature is refused with the fix (dump again for it)."""
    recipe = from_dict({"draft": {"kind": kind}, "dump": {"teacher": teacher, "topk": 8}})
    spec = feature_spec(recipe, type("Target", (), {"num_hidden_layers": 6})())
    manifest = {"features": manifest_features(spec, 64), "hidden_size": 64, "layers": spec["aux_layers"],
                "draft_kind": kind}
    assert check_shards_fit(manifest, kind, 64, [], Path("shards")) == spec["aux_layers"]
    for other in KINDS:
        if head_class(other).feature_spec != head_class(kind).feature_spec and manifest["features"].get(
                head_class(other).feature_spec.name) is None:
            with pytest.raises(EyasError, match=f"draft.kind {other} .*dump again"):
                check_shards_fit(manifest, other, 64, [], Path("shards"))


# ----------------------------------------------------------------------------- a new kind, declared in a test


def _toy_shapes(cfg, bias: bool) -> dict[str, tuple]:
    h = cfg.hidden_size
    shapes = {"toy.proj.weight": (h, 2 * h), "toy.proj.bias": (h,), "toy.layer.post_attention_layernorm.weight": (h,)}
    shapes.update(attention_shapes(cfg, "toy.layer.self_attn.", h, bias))
    shapes.update(mlp_shapes(cfg, "toy.layer.mlp."))
    return shapes


def _toy_name(name: str) -> str:
    return name.replace("fc.", "toy.proj.").replace("layers.0.", "toy.layer.")


def _eyas_name(name: str) -> str:
    return name.replace("toy.proj.", "fc.").replace("toy.layer.", "layers.0.")


class ToyHead(EagleHead):
    """EAGLE-1's network under another kind: its own feature, names, architecture and recipe rule."""

    kind = "toy"
    rules = kinds.KindRules(title="TOY")
    feature_spec = FeatureSpec("toy_hidden", 0, "toy feature")
    export = KindExport(
        formats={"sglang": FormatSpec("ToyForSpeculation", "TOY", _toy_shapes,
                                      lambda cfg, ctx: dict(llama_config("ToyForSpeculation", cfg, ctx), eyas=ctx.provenance),
                                      to_engine=_toy_name, to_eyas=_eyas_name, serve_flags=" --toy")},
        from_target=frozenset({"embed_tokens.weight", "lm_head.weight"}),
        default_steps=lambda cfg: 2)


@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setitem(KINDS, "toy", Kind(ToyHead.__module__, LAYER_PER_STEP))
    return ToyHead


def test_a_new_kind_plugs_in_from_its_declarations(toy_kind, tmp_path):
    config = _target_config("llama")
    torch.manual_seed(0)
    head = registry.build_head(DraftConfig(kind="eagle"), config)  # EAGLE-1's layers, saved as the toy kind
    toy = ToyHead(dataclasses.replace(head.config, kind="toy"))
    toy.load_state_dict(head.state_dict())
    with torch.no_grad():
        toy.fc.bias.normal_(0, 0.5)
    out = export.export_draft(save_draft(tmp_path / "ckpt", toy), "sglang", tmp_path / "out", dtype="float32")
    record = json.loads((out / export.MARKER).read_text())
    assert record["architecture"] == "ToyForSpeculation" and record["kind"] == "toy"
    assert "--speculative-algorithm TOY" in record["serve"] and record["serve"].endswith("--toy")
    assert "--speculative-num-steps 2" in record["serve"]  # the kind's default step count
    assert set(record["serve_all"]) == {"sglang"}  # the only format it declares
    assert set(load_file(str(out / "model.safetensors"))) == set(_toy_shapes(toy.config, False))
    back = export.load_exported(out, toy.embed_tokens.weight.detach(), toy.lm_head.weight.detach())
    assert isinstance(back, ToyHead)
    ids, feature, pos = torch.randint(0, 384, (1, 5)), torch.randn(1, 5, 64), torch.arange(5)
    with torch.no_grad():
        assert torch.equal(back.step(0, ids, feature, pos)[1], toy.step(0, ids, feature, pos)[1])
    with pytest.raises(EyasError, match="'toy' draft to vllm is not supported; export it with --to sglang"):
        export.export_draft(tmp_path / "ckpt", "vllm", tmp_path / "v")
    # its feature spec is what the trainer checks, its recipe rule what the recipe gets
    with pytest.raises(EyasError, match="draft.kind toy reads the target's toy feature"):
        check_shards_fit({"features": {"last_hidden": {}}, "hidden_size": 64}, "toy", 64, [], Path("s"))
    check_shards_fit({"features": {"toy_hidden": {}, "last_hidden": {}}, "hidden_size": 64}, "toy", 64, [], Path("s"))
    recipe = Recipe()
    recipe.draft.kind, recipe.draft.num_steps, recipe.train.ttt_steps = "toy", 3, 2
    with pytest.raises(EyasError, match="the toy draft has draft.num_steps=3 layers"):
        check_mtp_unroll(recipe)


def _write_golden() -> None:
    import tempfile

    out = {}
    for name in CASES:
        with tempfile.TemporaryDirectory() as root:
            out[name] = _export_case(name, Path(root))
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(out)} cases to {GOLDEN}")


if __name__ == "__main__" and "--write" in sys.argv:
    _write_golden()


# ----------------------------------------------------------------------------- a kind's own recipe keys


def test_a_recipe_without_kind_keys_loads_without_torch():
    """The recipe reader imports a kind's module (torch, transformers: seconds) only for a recipe that sets one
    of the kind's own keys; the layout that sizes its unroll comes from the registry line."""
    code = ("import sys; from eyas.config import load_recipe; r = load_recipe(None, ['draft.kind=mtp', "
            "'draft.num_steps=2']); assert r.train.ttt_steps == 2; assert 'torch' not in sys.modules; "
            "load_recipe(None, ['draft.kind=mtp', 'draft.mtp_feed=target']); assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tempfile.gettempdir())


def test_a_kind_key_belongs_to_its_kinds():
    """A kind's key in a recipe of another kind is refused naming the kinds it belongs to; a near miss is named."""
    with pytest.raises(EyasError, match=r"'draft.mask_token_id' is 3, but draft.kind is 'eagle3': it is an option "
                                        r"of peagle \(P-EAGLE\), dflash \(DFlash\) and dspark \(DSpark\); set draft.kind=peagle"):
        from_dict({"draft": {"kind": "eagle3", "mask_token_id": 3}})
    with pytest.raises(EyasError, match="unknown recipe key 'draft.mask_tokn_id'.*mask_token_id"):
        from_dict({"draft": {"kind": "dflash", "mask_tokn_id": 3}})
    with pytest.raises(EyasError, match="'draft.mtp_feed' is 'x'; choose one of: chain, target"):
        from_dict({"draft": {"kind": "mtp", "mtp_feed": "x"}})
    recipe = from_dict({"draft": {"kind": "dflash", "num_layers": 2, "mask_token_id": 7}})
    assert recipe.draft.options == {"num_layers": 2, "mask_token_id": 7}
    assert recipe.to_dict()["draft"]["num_layers"] == 2 and "options" not in recipe.to_dict()["draft"]
    assert from_dict(recipe.to_dict()).draft == recipe.draft  # written back flat, read back the same


def test_a_kind_sets_its_recipe_defaults_unless_the_recipe_does(monkeypatch):
    monkeypatch.setitem(KINDS, "toy", Kind(ToyHead.__module__, LAYER_PER_STEP, {"train.loss": "ce:0.1,tv:0.9"}))
    assert from_dict({"draft": {"kind": "toy"}}).train.loss == "ce:0.1,tv:0.9"
    assert from_dict({"draft": {"kind": "toy"}, "train": {"loss": "tv"}}).train.loss == "tv"
    assert from_dict({"draft": {"kind": "eagle3"}}).train.loss == Recipe().train.loss
