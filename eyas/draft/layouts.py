"""The ways a draft head drafts its tokens: each a `Layout`, which a kind's registry line names (`eyas.draft.registry`).

A stage never asks a head which kind it is or how it is built. It asks the head's layout, and keeps
one implementation per layout in one table: the training-time scoring (`eyas.train.ttt.SCORING`), the
eval adapter one prompt at a time (`eyas.eval.head_draft.ADAPTERS`) and the batched one
(`eyas.eval.batched.BATCHED`). What differs between kinds of one layout (the layers, how step 0 reads
the target's features, EAGLE-1's feature regression, MTP's feed, P-EAGLE's mask slots) the kind
supplies as methods of its head. docs/heads.md, "Adding a head kind", is the one text on adding a kind;
a new way of drafting is a new `Layout` here plus its row in each of those tables
(`tests/test_draft_plugins.py` checks that every table has every layout).

This module imports no torch: the recipe checks (`eyas.recipe_checks`, `eyas.recipe_kinds`) ask a kind's layout how its unroll is
sized before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import EyasError


@dataclass(frozen=True)
class Layout:
    """One way of drafting: what the unroll, the eval adapters and the memory plan build for it."""

    name: str
    summary: str  # for docs and messages
    # each draft step reads weights no other step reads (a layer per step): a step outside the unroll
    # leaves them without a gradient, and the memory plan counts them once, not once per step
    weights_per_step: bool = False
    # what `draft.num_steps` counts when it also fixes the unroll (one step per layer or mask slot); "" when
    # the unroll's depth (`train.ttt_steps`) is the recipe's own choice
    step_unit: str = ""
    # a step after the first reads the token the step before drafted (with the draft token feed): a tree-aware
    # unroll can choose that token (`train.sibling_feed`)
    reads_drafted_token: bool = False

    def __str__(self) -> str:
        return self.name

    def default_unroll(self, num_steps: int) -> int | None:
        """`train.ttt_steps` when the recipe does not set it (None: the recipe section's own default)."""
        return num_steps if self.step_unit else None

    def check_unroll(self, kind: str, ttt_steps: int, num_steps: int) -> None:
        """Refuse an unroll that leaves a layer (slot) untrained or asks for one the draft does not have."""
        if not self.step_unit or ttt_steps == num_steps:
            return
        unit = self.step_unit
        if ttt_steps > num_steps:
            raise EyasError(f"recipe key 'train.ttt_steps' is {ttt_steps} but the {kind} draft has only "
                            f"draft.num_steps={num_steps} {unit}; set train.ttt_steps <= draft.num_steps")
        # each layer (slot) drafts one step and learns only from its own step of the unroll: those
        # past it would keep their random init, and eval and engines would still draft with them
        raise EyasError(f"recipe key 'train.ttt_steps' is {ttt_steps} but the {kind} draft has draft.num_steps="
                        f"{num_steps} {unit}: {unit} {ttt_steps + 1}-{num_steps} would get no gradient and draft at "
                        f"their random init; set train.ttt_steps={num_steps} (or draft.num_steps={ttt_steps})")


SHARED_LAYER = Layout(
    "shared_layer", "one layer unrolled over the draft steps: step k reads step k-1's hidden and drafted token, "
    "and attends to the context and its own earlier steps (eagle, eagle3)", reads_drafted_token=True)
PARALLEL_SLOTS = Layout(
    "parallel_slots", "one shared layer; step 0 reads the target's feature and every later step a mask slot, "
    "so every step is known before any is drafted and all run in one forward (peagle)")
LAYER_PER_STEP = Layout(
    "layer_per_step", "one layer per draft step, each with its own KV cache, step k reading the data's token "
    "(mtp)", weights_per_step=True, step_unit="layers", reads_drafted_token=True)
BLOCK = Layout(
    "block", "a non-causal stack drafts the anchor's block in one forward, over the target's features as "
    "context; each block slot predicts one draft step (dflash: its mask rows; dspark: the anchor's row too)",
    step_unit="block slots")

LAYOUTS: tuple[Layout, ...] = (SHARED_LAYER, PARALLEL_SLOTS, LAYER_PER_STEP, BLOCK)
