"""The recipe's checks and the questions stages ask of it: what a recipe may hold beyond each key's type.

A value out of its choices or range is an error naming the key (`validate`, run on every recipe read); so is a
combination of keys that cannot work together. Checks that need the target's config (a layer index past its depth)
live in `check_against_target`, called by the stages once the target config is known. The rules a kind adds (its
own keys, loss terms, unroll) are asked of the kind (`eyas.recipe_kinds`).
"""

from __future__ import annotations

from typing import Any

from eyas.draft.features import default_layers
from eyas.draft.registry import KINDS
from eyas.errors import EyasError
from eyas.recipe_kinds import check_head_losses, check_kind_variants, check_mtp_unroll, reads_drafted_tokens, token_feed
from eyas.recipe_schema import CHOICES, LOSS_NAMES, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, DataConfig, Recipe, suggest
from eyas.shapes import Shape, parse_shape, ranks_needed
from eyas.steering import parse_categories


def _get(recipe: Recipe, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(recipe, section), key)


def validate(recipe: Recipe) -> Recipe:
    """Range and choice checks that need no target; raises EyasError naming the key."""
    for key, choices in CHOICES.items():
        value = _get(recipe, key)
        if value not in choices:
            raise EyasError(f"recipe key '{key}' is {value!r}; choose one of: {', '.join(choices)}")
    for key in POSITIVE:
        if not _get(recipe, key) > 0:
            raise EyasError(f"recipe key '{key}' must be > 0, got {_get(recipe, key)!r}")
    for key in NON_NEGATIVE:
        if _get(recipe, key) < 0:
            raise EyasError(f"recipe key '{key}' must be >= 0, got {_get(recipe, key)!r}")
    for key, (lo, hi, kind) in UNIT_INTERVAL.items():
        v = _get(recipe, key)
        ok_lo = v >= lo if kind in ("closed", "closed-open") else v > lo
        ok_hi = v <= hi if kind in ("closed", "open-closed") else v < hi
        if not (ok_lo and ok_hi):
            lb = "[" if kind in ("closed", "closed-open") else "("
            rb = "]" if kind in ("closed", "open-closed") else ")"
            raise EyasError(f"recipe key '{key}' must be in {lb}{lo}, {hi}{rb}, got {v!r}")
    check_head_losses(recipe.draft.kind, parse_loss_mix(recipe.train.loss))
    if len(recipe.train.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in recipe.train.betas):
        raise EyasError(f"recipe key 'train.betas' must be two numbers in [0, 1), got {recipe.train.betas!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in recipe.dump.layers):
        raise EyasError(f"recipe key 'dump.layers' must be a list of integers, got {recipe.dump.layers!r}")
    if recipe.dump.layers and len(recipe.dump.layers) != 3:
        raise EyasError(f"recipe key 'dump.layers' takes 3 layer indices (low, middle, high), got {recipe.dump.layers!r}")
    if recipe.dump.backend == "vllm" and recipe.dump.teacher == "topk":
        raise EyasError("dump.backend=vllm stores no top-k teacher (that needs the target's lm_head over every "
                        "position); set dump.teacher=last_hidden, or dump.backend=transformers")
    _check_stream(recipe)
    if not recipe.eval.shapes or not all(isinstance(s, str) for s in recipe.eval.shapes):
        raise EyasError(f"recipe key 'eval.shapes' must be a non-empty list of shape strings, got {recipe.eval.shapes!r}")
    selected_shape(recipe)  # parses, or names the key
    _check_tree_levers(recipe)
    if not all(isinstance(d, str) and d for d in recipe.eval.drafts):
        raise EyasError(f"recipe key 'eval.drafts' must be a list of checkpoint folders or draft specs (truncated:N, "
                        f"mixture:LAM), got {recipe.eval.drafts!r}")
    _check_self_prompts(recipe.data)
    check_kind_variants(recipe)
    if not recipe.run.name or "/" in recipe.run.name or recipe.run.name in (".", ".."):
        raise EyasError(f"recipe key 'run.name' must be a non-empty name without '/' (not . or ..), got {recipe.run.name!r}")
    check_mtp_unroll(recipe)  # here, not at train: `eyas prepare` refuses a bad mtp recipe before any work
    return recipe


def selected_shape(recipe: Recipe) -> Shape:
    """The shape `checkpoints/best` is chosen for: train.select_shape, else the first of eval.shapes."""
    key = "train.select_shape" if recipe.train.select_shape else "eval.shapes"
    try:
        return parse_shape(recipe.train.select_shape or recipe.eval.shapes[0])
    except EyasError as exc:
        raise EyasError(f"recipe key '{key}': {exc}") from None


def tree_width(recipe: Recipe) -> int:
    """The width the tree-aware levers train for: train.tree_width, else the select shape's."""
    return recipe.train.tree_width or ranks_needed(selected_shape(recipe))


def _check_tree_levers(recipe: Recipe) -> None:
    """Refuse a sibling feed where it would change nothing: a width of 1 (the draft feed itself), or an unroll
    whose steps do not read the token the step before drafted (imports the kind only when the key is set)."""
    train, kind = recipe.train, recipe.draft.kind
    if not train.sibling_feed or kind not in KINDS:
        return
    if tree_width(recipe) == 1:
        raise EyasError("train.sibling_feed follows the target's token where it is among the draft's top W, but W "
                        "is 1 (train.tree_width 0 and a chain to select for), which is the draft feed itself; set "
                        "train.tree_width to the served tree's width, or train.select_shape to that tree")
    if not reads_drafted_tokens(recipe):
        reads = ("the data's tokens (ttt_token_feed: data)" if token_feed(recipe) != "draft"
                 else f"no drafted token ({KINDS[kind].layout})")
        raise EyasError(f"train.sibling_feed chooses the token an unrolled step reads, but a {kind} draft's steps "
                        f"read {reads}; set train.sibling_feed: false")


def _check_self_prompts(data: DataConfig) -> None:
    if data.self_prompts and not data.regenerate:
        raise EyasError("data.self_prompts needs data.regenerate: true: the target-written prompts have no replies "
                        "until the target writes them")
    if data.self_prompt_turns not in (1, 2):
        raise EyasError(f"recipe key 'data.self_prompt_turns' is {data.self_prompt_turns!r}; choose 1 (one exchange) "
                        "or 2 (the target also writes a follow-up user turn)")
    if (data.self_prompt_categories or data.self_prompt_turns > 1) and not data.self_prompts:
        raise EyasError("data.self_prompt_categories and data.self_prompt_turns steer target-written prompts, but "
                        "data.self_prompts is 0; set data.self_prompts to the number of conversations to write")
    parse_categories(data.self_prompt_categories)  # an EyasError names an entry that is not a category
    if data.source == "none" and not data.self_prompts:
        raise EyasError("data.source is 'none' and data.self_prompts is 0: there is no data; set data.self_prompts "
                        "to the number of conversations to write, or name a data source")


def parse_loss_mix(spec: str) -> dict[str, float]:
    """`forward_kl` -> {forward_kl: 1.0}; `forward_kl:0.9,ce:0.1` -> weights per loss."""
    mix: dict[str, float] = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        if name not in LOSS_NAMES:
            raise EyasError(f"recipe key 'train.loss': unknown loss {name!r}; {suggest(name, list(LOSS_NAMES))}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise EyasError(f"recipe key 'train.loss': weight {weight!r} of '{name}' is not a number") from None
        if w < 0:
            raise EyasError(f"recipe key 'train.loss': weight of '{name}' must be >= 0, got {w}")
        mix[name] = w
    if sum(mix.values()) <= 0:
        raise EyasError("recipe key 'train.loss': the loss weights sum to 0")
    return mix


def check_against_target(recipe: Recipe, target_config: Any) -> None:
    """Checks that need the target's config; raises EyasError naming the key."""
    depth = int(target_config.num_hidden_layers)
    for idx in recipe.dump.layers:
        if not 0 <= idx <= depth:
            raise EyasError(
                f"recipe key 'dump.layers' has index {idx}, but the target has {depth} layers "
                f"(HF hidden_states indices 0..{depth}); the default is {default_layers(depth)}"
            )
    check_mtp_unroll(recipe)  # load_recipe refuses it first; a recipe built with dataclasses.replace meets it here


def _check_stream(recipe: Any) -> None:
    """`train.source: stream`: engines from one place, and features a vLLM engine can capture."""
    train = recipe.train
    if train.source != "stream":
        return
    if recipe.dump.teacher == "topk":
        raise EyasError("train.source=stream captures no top-k teacher (that needs the target's lm_head over every "
                        "position); set dump.teacher=last_hidden")
    endpoints = train.stream_endpoints
    if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in endpoints):
        raise EyasError(f"recipe key 'train.stream_endpoints' must be a list of engine URLs (http://HOST:PORT/v1), "
                        f"got {endpoints!r}")
    if bool(endpoints) == bool(train.stream_engines):
        raise EyasError("train.source=stream needs its engines from one place: train.stream_engines (engines this "
                        "run starts) or train.stream_endpoints (engines already running), not both and not neither; "
                        f"got stream_engines={train.stream_engines}, stream_endpoints={endpoints!r}")
