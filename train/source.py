"""Where a run's batches come from: the shards' readers; online, the prepared data with the target in the loop;
streamed, the prepared data with vLLM engines capturing each sample's features (`eyas.train.stream`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from eyas.data.prepare import load_prepared
from eyas.data.vocab import VOCAB_FILE, build_vocab, count_tokens, load_vocab
from eyas.draft.registry import head_class, uses_draft_vocab
from eyas.recipe_schema import Recipe
from eyas.targets import load_target
from eyas.train.data import open_shards
from eyas.train.loader import to_device
from eyas.train.online import OnlineFeatures, PreparedReader
from eyas.train.stream import open_stream


@dataclass
class Source:
    """Where batches come from: loaders for both splits and, online, the target that makes features."""

    train_reader: Any
    heldout_reader: Any  # None: evaluate on a deterministic slice of the train data
    aux_layers: list[int]
    d2t: torch.Tensor | None
    features: Any = None  # OnlineFeatures when train.source is online
    description: str = ""
    stream: Any = None  # the engines and their readers when train.source is stream

    def close(self, trained: Any = None) -> None:
        """Stop what the source started: the online target's hooks, the stream's engines (and write its report, with
        `trained`: how often each train sample went into a step)."""
        if self.features is not None:
            self.features.close()
        if self.stream is not None:
            self.stream.close(trained)

    def prepare(self, batch: dict, device: Any) -> dict:
        """A loader's batch on the device, with the target's features added when online."""
        batch = to_device(batch, device)
        if self.features is not None:
            batch = self.features(batch)
        return batch


@contextlib.contextmanager
def closed_on_error(source: Source) -> Iterator[Source]:
    """Close `source` (stop its engines, its target's hooks) when the block raises; keep it open otherwise."""
    try:
        yield source
    except BaseException:
        source.close()
        raise


def open_source(recipe: Recipe, target_config: Any, identity: str, device: Any, target_model: Any = None) -> Source:
    kind, run_dir = recipe.draft.kind, recipe.run_dir
    want_vocab = uses_draft_vocab(recipe.draft)
    if recipe.train.source == "shards":
        shards = open_shards(run_dir, kind, int(target_config.hidden_size), recipe.dump.layers, identity)
        d2t = load_vocab(shards["root"])[0] if want_vocab else None
        reader = shards["train"]
        desc = (f"shards {shards['root']} ({len(reader)} samples, {reader.manifest.get('num_tokens')} tokens, "
                f"{reader.manifest.get('encoding')})")
        return Source(reader, shards["heldout"], shards["layers"], d2t, None, desc)
    if recipe.train.source == "stream":
        stream, layers = open_stream(recipe, target_config, identity)
        train_reader = stream.readers["train"]
        d2t = _online_vocab(recipe, train_reader, int(target_config.vocab_size)) if want_vocab else None
        heldout = stream.readers["heldout"]
        return Source(train_reader, heldout if len(heldout) else None, layers, d2t, None,
                      f"stream: {len(stream.fleet.engines)} vLLM engine(s) capturing {len(train_reader)} samples, "
                      f"window {recipe.train.stream_window}, cache {'kept' if train_reader.cache else 'none'}",
                      stream)
    if target_model is None:
        target_model, _ = load_target(recipe.target, device)
    layers = head_class(kind).feature_spec.target_layers(recipe.dump.layers, int(target_config.num_hidden_layers))
    train_reader = PreparedReader(load_prepared(run_dir, "train"))
    heldout = load_prepared(run_dir, "heldout")
    d2t = _online_vocab(recipe, train_reader, int(target_config.vocab_size)) if want_vocab else None
    return Source(train_reader, PreparedReader(heldout) if len(heldout) else None, layers, d2t,
                  OnlineFeatures(target_model, layers),
                  f"online: target in the loop over {run_dir / 'prepared'} ({len(train_reader)} samples)")


def _online_vocab(recipe: Recipe, reader: Any, vocab_size: int) -> torch.Tensor:
    """The dump's vocabulary when one exists, else the same one built from the prepared data."""
    shards = recipe.run_dir / "shards"
    if (shards / VOCAB_FILE).is_file():
        return load_vocab(shards)[0]
    return build_vocab(count_tokens(reader.dataset, vocab_size), recipe.dump.draft_vocab_size)[0]
