"""The target feature a head kind reads at step 0: what the dump writes into the shard manifest and
what the trainer checks the shards hold before any step.

A kind declares one `FeatureSpec` (`DraftHead.feature_spec`); its `name` is the manifest's
`features` key and the batch key the trainer reads (`DraftHead.feature`). The last hidden state
is also the teacher's input (the frozen lm_head recomputes the distribution from it), so the dump
may write `LAST_HIDDEN` whatever the kind reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError


@dataclass(frozen=True)
class FeatureSpec:
    """One feature of the dump: the target's last hidden state, or several target layers concatenated."""

    name: str  # manifest `features` key and batch key
    fused_layers: int  # target layers concatenated along the hidden axis (0: the last hidden state alone)
    description: str  # how messages name it

    def target_layers(self, recipe_layers: list[int], depth: int) -> list[int]:
        """The target's hidden-state indices it concatenates: the recipe's `dump.layers`, else the default three of a
        `depth`-layer target; none for the last hidden state, which is not a layer choice."""
        if not self.fused_layers:
            return []
        return list(recipe_layers) if recipe_layers else default_layers(depth)

    def width(self, hidden: int) -> int:
        """Its width per token for a target of hidden size `hidden`."""
        return hidden * max(1, self.fused_layers)

    def manifest_entry(self, hidden: int, encodings: list[str], layers: list[int] | None = None) -> dict:
        """The manifest's entry for it: layers, encodings and shape of what the dump stored."""
        if not self.fused_layers:
            return {"encoding": encodings[0], "shape": [hidden]}
        layers = list(layers or [])
        return {"layers": layers, "encodings": list(encodings), "shape": [len(layers) * hidden]}

    def check(self, manifest: dict, kind: str, hidden_size: int, recipe_layers: list[int], where: Path) -> None:
        """Raise EyasError unless the shards of `manifest` hold this feature for a `kind` head."""
        found = manifest.get("features", {}).get(self.name)
        if not self.fused_layers:
            if found is None:
                raise EyasError(f"draft.kind {kind} reads the target's {self.description}, which the shards in "
                                f"'{where}' do not hold; dump again with this draft kind")
            return
        if found is None or len(found.get("layers", [])) != self.fused_layers:
            raise EyasError(f"draft.kind {kind} needs {self.description} ({self.name}), but the shards in '{where}' "
                            f"were dumped for draft.kind={manifest.get('draft_kind')!r} without them; "
                            f"dump again with draft.kind={kind}")
        if int(found["shape"][0]) != self.width(hidden_size):
            raise EyasError(f"the fused layers in '{where}' are {found['shape'][0]} wide, expected "
                            f"{self.fused_layers} x {hidden_size}")
        layers = list(manifest.get("layers") or [])
        if recipe_layers and list(recipe_layers) != layers:
            raise EyasError(f"recipe dump.layers is {list(recipe_layers)} but the shards in '{where}' hold layers "
                            f"{layers}; dump again or set dump.layers={layers}")


# The target's final-norm output (HF `hidden_states[-1]`): EAGLE-1's and MTP's feature, and the teacher's input.
LAST_HIDDEN = FeatureSpec("last_hidden", 0, "last hidden state")
# Three target layers (low, middle, high; recipe `dump.layers`) concatenated: EAGLE-3's feature.
FUSED_LAYERS = FeatureSpec("aux_hidden", 3, "the three fused layers")


def default_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's fused layers as HF `hidden_states` indices: low, middle, high.

    Three distinct indices that serving engines capture (1..L-1: the input of a decoder layer): SGLang
    and vLLM take each layer once, so a repeated index would hand the draft fewer features than it was
    trained on. Below 7 layers the usual [2, L/2, L-3] repeats one, and the three spread over 1..L-1.
    Below 4 layers 1..L-1 holds fewer than three: the highest three of 0..L (a draft to train and evaluate; its
    export is refused, naming the indices no engine captures)."""
    if num_hidden_layers < 4:
        return [max(0, num_hidden_layers - 2 + i) for i in range(3)]
    usual = [2, num_hidden_layers // 2, num_hidden_layers - 3]
    if len(set(usual)) == 3:
        return usual
    return [1, num_hidden_layers // 2, num_hidden_layers - 1]
