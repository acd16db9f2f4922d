"""`eyas dump RECIPE`: run the frozen target over the prepared tokens and write feature shards.

What is stored per token depends on the draft (see `feature_spec`): EAGLE-3 needs its three
fused layers (`aux_hidden`) and, unless the teacher is a stored top-k, the last hidden state
from which trainers recompute the teacher through the frozen lm_head; EAGLE-1 and mtp heads
read the last hidden state only. Only the decoder stack runs (no lm_head over every position,
which on a small-hidden, large-vocab target costs more than the layers), with forward hooks
capturing the needed layers as they pass.

The work is planned from the sample lengths alone: samples sorted longest first, cut into
shards of about `dump.shard_tokens` tokens, each shard cut into `dump.token_budget` batches.
So a shard's contents depend only on the data and the settings, never on which process wrote
it or when: shard i of a 4-process dump, of a resumed dump and of a one-process dump are the
same bytes (on the same hardware). Ranks (RANK/WORLD_SIZE from torchrun, accelerate or a SLURM
array) take shards i % WORLD_SIZE == RANK.

Host memory does not grow with `dump.shard_tokens`: each batch's rows go straight to their place
in the shard file (`ShardWriter`: the plan fixes every sample's length, so the file's layout is
known before the first batch), so a process holds about two batches of encoded features, not
a shard (at the 8B recipe's settings an estimated 2.6 GB per rank, against ~70 GB for the
whole-shard writer it replaced; docs/results.md, "Dump memory").
A shard is written atomically with a sidecar recording its sha256, hashed once as it is
finished. A rerun trusts a finished shard whose sidecar, size and header fit (no re-hashing:
the reader checks every sample's CRC-32 as training reads it), redoes missing, truncated or
foreign ones (a shard whose header carries another plan fingerprint, copied in from another
dump with its sidecar), and with `--reverify` (`dump(..., reverify=True)`) hashes every
finished shard again and redoes the corrupt ones. A single-process rerun also removes the
temporary files (`.NAME.tmp.PID`) that a killed writer left behind.
Rank 0 writes index, vocabulary and manifest once every shard exists: co-launched ranks
(torchrun / accelerate) wait for each other; independent ones (a SLURM array) leave that to a
final single-process `eyas dump --finalize`, which loads no weights and refuses a missing shard
(a plain rerun of `eyas dump` that finds everything done does the same, with the target loaded).

Layout: `run_dir/shards/` (train) and `run_dir/shards/heldout/`, see `eyas.data.shard_format`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.config import save_resolved
from eyas.cpus import threads_per_process
from eyas.data.batches import budget_batches
from eyas.data.dump_vllm import VllmCapture, vllm_version
from eyas.data.prepare import load_prepared, prepared_info, tokenizer_identity
from eyas.data.shard_format import MANIFEST, SCHEMA_VERSION, encode, ids_dtype, shard_name
from eyas.data.shard_writer import ShardWriter, build_index, check_shard, read_sidecar, wait_for
from eyas.data.vocab import count_tokens, write_vocab
from eyas.draft.features import FUSED_LAYERS, LAST_HIDDEN
from eyas.draft.registry import head_class
from eyas.errors import EyasError
from eyas.io import atomic_write_json, remove_stale_temps
from eyas.recipe_checks import check_against_target
from eyas.recipe_schema import Recipe
from eyas.targets import (
    IDENTITY_SCHEME,
    load_target,
    load_target_config,
    load_tokenizer,
    pick_device,
    resolve_dtype,
    resolve_target_path,
    target_identity,
)

PLAN = "plan.json"
DEFAULT_BACKEND = "transformers"  # a plan without `backend` was dumped by transformers (every dump before the key)
PLAN_DEFAULTS = {"backend": DEFAULT_BACKEND}  # what a plan key missing from a plan stands for


# ----------------------------------------------------------------------------- what to store


def feature_spec(recipe: Any, target_config: Any) -> dict:
    """Which features this draft kind needs, with layers and encodings."""
    depth = int(target_config.num_hidden_layers)
    dump = recipe.dump
    spec: dict = {"aux_layers": [], "last_hidden": False, "topk": 0}
    spec["aux_layers"] = head_class(recipe.draft.kind).feature_spec.target_layers(dump.layers, depth)
    # a kind that reads no target layer reads the last hidden state as its feature; else it is the teacher's input
    spec["last_hidden"] = not spec["aux_layers"] or dump.teacher == "last_hidden"
    if dump.teacher == "topk":
        spec["topk"] = int(dump.topk)
    low = dump.low_layer_encoding or dump.encoding
    spec["aux_encodings"] = [low] + [dump.encoding] * (len(spec["aux_layers"]) - 1) if spec["aux_layers"] else []
    spec["last_encoding"] = dump.encoding
    return spec


def manifest_features(spec: dict, hidden: int) -> dict:
    """The manifest's `features`: each stored feature's entry as its `FeatureSpec` writes it, and the top-k teacher."""
    features = {}
    if spec["aux_layers"]:
        features[FUSED_LAYERS.name] = FUSED_LAYERS.manifest_entry(hidden, spec["aux_encodings"], spec["aux_layers"])
    if spec["last_hidden"]:
        features[LAST_HIDDEN.name] = LAST_HIDDEN.manifest_entry(hidden, [spec["last_encoding"]])
    if spec["topk"]:
        features["topk_values"] = {"encoding": "fp16", "shape": [spec["topk"]], "meaning": "teacher log-probabilities"}
        features["topk_ids"] = {"encoding": "ids", "shape": [spec["topk"]]}
    return features


class HiddenCapture:
    """Runs the target's decoder stack and returns the wanted HF `hidden_states` entries.

    Index 0 is the embedding output, index i (1..L-1) the output of decoder layer i-1, and index L
    (= last_hidden) the final-norm output, as in HF `output_hidden_states`. Hooks keep only
    the wanted layers alive instead of all L+1.
    """

    def __init__(self, model: Any, aux_layers: list[int]):
        self.model = model
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.depth = len(self.decoder.layers)
        self.aux_layers = aux_layers
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        for idx in set(aux_layers):
            if idx == 0:
                module = self.decoder.embed_tokens
            elif idx < self.depth:
                module = self.decoder.layers[idx - 1]
            else:
                continue  # index L is the final-norm output, taken from the decoder's result
            self._hooks.append(module.register_forward_hook(self._hook(idx)))

    def _hook(self, idx: int):
        def keep(_module, _inputs, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output
        return keep

    def __call__(self, input_ids: torch.Tensor, lengths: Any = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Right-padded ids [B, T] -> ([aux [B, T, H] ...], last [B, T, H]). No mask is needed:
        with right padding and causal attention no real token ever sees a pad (so `lengths`, which
        `VllmCapture` needs, is not read here)."""
        self._captured.clear()
        out = self.decoder(input_ids=input_ids, use_cache=False)
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        aux = [last if idx >= self.depth else self._captured[idx] for idx in self.aux_layers]
        self._captured.clear()
        return aux, last

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def teacher_topk(model: Any, last: torch.Tensor, k: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probabilities of the target's next-token distribution, computed in chunks."""
    head = model.get_output_embeddings()
    values, ids = [], []
    for start in range(0, last.shape[0], chunk):
        logits = head(last[start:start + chunk]).float()
        top = logits.topk(k, dim=-1)
        values.append((top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).to(torch.float16))
        ids.append(top.indices)
    return torch.cat(values), torch.cat(ids)


# ----------------------------------------------------------------------------- the plan


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[np.ndarray]:
    """Sample indices per shard: longest first, about `shard_tokens` tokens per shard."""
    order = np.argsort(-lengths, kind="stable")
    shards, start, total = [], 0, 0
    for pos, idx in enumerate(order):
        length = int(lengths[idx])
        if pos > start and total + length > shard_tokens:
            shards.append(order[start:pos])
            start, total = pos, 0
        total += length
    if start < len(order):
        shards.append(order[start:])
    return shards


def data_fingerprint(dataset) -> str:
    """sha256 over the prepared tokens and masks (arrow buffers; seconds for billions of tokens)."""
    if getattr(dataset, "_indices", None) is not None:
        dataset = dataset.flatten_indices()
    h = hashlib.sha256()
    for column in ("input_ids", "loss_mask"):
        for chunk in dataset.data.column(column).chunks:
            h.update(np.asarray(chunk.offsets).astype(np.int64).tobytes() if len(chunk) else b"")
            h.update(chunk.flatten().to_numpy(zero_copy_only=False).tobytes())
    return h.hexdigest()[:20]


def sample_lengths(dataset) -> np.ndarray:
    import pyarrow.compute as pc

    if getattr(dataset, "_indices", None) is not None:
        dataset = dataset.flatten_indices()
    if len(dataset) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(pc.list_value_length(dataset.data.column("input_ids")).to_numpy(zero_copy_only=False), dtype=np.int64)


def check_plan(out_dir: Path, plan: dict, rank: int) -> None:
    """Refuse to mix shards made with other data or settings into this dump."""
    path = out_dir / PLAN
    if path.is_file():
        old = json.loads(path.read_text())
        if old != plan:
            changed = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            # a setting's old and new values; a key missing on one side is its default (PLAN_DEFAULTS)
            shown = [f"{k} ({old.get(k, PLAN_DEFAULTS.get(k))} -> {plan.get(k, PLAN_DEFAULTS.get(k))})"
                     if k not in ("fingerprint", "data") else k for k in changed]
            raise EyasError(
                f"'{out_dir}' holds shards dumped with other data or settings (changed: {', '.join(shown)}); "
                "delete that folder to dump again, or use another run.name"
            )
    elif rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan)


# ----------------------------------------------------------------------------- one shard


def pad_right(sequences: list[list[int]], pad_id: int = 0) -> torch.Tensor:
    longest = max(len(s) for s in sequences)
    out = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for b, seq in enumerate(sequences):
        out[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def encode_features(spec: dict, aux: list[torch.Tensor], last: torch.Tensor, real: torch.Tensor,
                  model: Any) -> dict[str, torch.Tensor]:
    """Select real tokens (sample after sample) and encode them; returns CPU tensors."""
    out: dict[str, torch.Tensor] = {}
    for j, (feature, encoding) in enumerate(zip(aux, spec["aux_encodings"])):
        for suffix, t in encode(feature[real], encoding).items():
            out[f"aux_hidden.{j}{suffix}"] = t.cpu()
    last_real = last[real]
    if spec["last_hidden"]:
        for suffix, t in encode(last_real, spec["last_encoding"]).items():
            out[f"last_hidden{suffix}"] = t.cpu()
    if spec["topk"]:
        values, ids = teacher_topk(model, last_real, spec["topk"])
        out["topk_values"], out["topk_ids"] = values.cpu(), ids.cpu()
    return out


def shard_batches(capture: Any, dataset, indices: np.ndarray, lengths: np.ndarray, spec: dict,
                  token_budget: int, vocab_size: int, device: Any, progress=None
                  ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """One shard's batches in plan order: (number of samples, their rows of every per-token tensor
    on the CPU: features, input_ids, loss_mask). Only the batch's rows are read from the dataset."""
    id_type = ids_dtype(vocab_size)
    for batch in budget_batches(np.arange(len(indices)), lengths, token_budget):
        rows = dataset[[int(indices[i]) for i in batch]]
        ids = pad_right(rows["input_ids"]).to(device)
        real = (torch.arange(ids.shape[1])[None, :] < torch.as_tensor(lengths[batch])[:, None]).to(device)
        with torch.inference_mode():
            aux, last = capture(ids, lengths[batch])
            encoded = encode_features(spec, aux, last, real, capture.model)
        if "topk_ids" in encoded:
            encoded["topk_ids"] = encoded["topk_ids"].to(torch.int32).to(id_type)
        encoded["input_ids"] = torch.as_tensor(np.concatenate(rows["input_ids"]), dtype=torch.int32).to(id_type)
        encoded["loss_mask"] = torch.as_tensor(np.concatenate(rows["loss_mask"]), dtype=torch.uint8)
        if progress is not None:
            progress.update(int(lengths[batch].sum()))
        yield len(batch), encoded


def stream_rows(batches: Iterable[tuple[int, dict[str, torch.Tensor]]], writer: ShardWriter,
                thread: ThreadPoolExecutor) -> None:
    """Hand each batch to `writer` on `thread`, one write in flight: the disk write and the CRCs of
    a batch overlap the next batch's forward, and the host holds two batches at most."""
    writing: Future | None = None
    try:
        for samples, rows in batches:
            if writing is not None:
                writing.result()
            writing = thread.submit(writer.write, rows, samples)
        if writing is not None:
            writing.result()
    except BaseException:
        if writing is not None:
            wait([writing])  # the caller's abort must not close the file under a running write
        raise


# ----------------------------------------------------------------------------- one split


def distributed_env() -> tuple[int, int, bool]:
    """(rank, world_size, co_launched): co-launched ranks (torchrun/accelerate) can wait for each other."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise EyasError(f"RANK={rank} is outside WORLD_SIZE={world}; check the launcher's environment")
    co_launched = "TORCHELASTIC_RUN_ID" in os.environ or "MASTER_ADDR" in os.environ
    return rank, world, co_launched


def _manifest_records(out_dir: Path) -> dict[str, dict]:
    """The shard records of the split's existing manifest, by file ({} when there is none)."""
    try:
        return {r["file"]: r for r in json.loads((out_dir / MANIFEST).read_text())["shards"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def dump_split(dataset, out_dir: Path, plan: dict, capture: Any, spec: dict, dump_cfg: Any,
               vocab_size: int, device: Any, rank: int, world: int, label: str, reverify: bool = False) -> list[int]:
    """Write this rank's missing or bad shards of one split; returns all shard indices of the split.

    Finished shards are trusted without re-hashing (sidecar, size and header checked) unless
    `reverify`. `capture=None` (`eyas dump --finalize`): nothing may run, so a shard still to
    write is refused, naming it."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    check_plan(out_dir, plan, rank)
    lengths = sample_lengths(dataset)
    shards = plan_shards(lengths, dump_cfg.shard_tokens)
    mine = [i for i in range(len(shards)) if i % world == rank]
    recorded = _manifest_records(out_dir)
    problems = {i: check_shard(out_dir, i, full=reverify, expect_plan=plan["fingerprint"],
                               recorded=recorded.get(shard_name(i))) for i in mine}
    todo = [i for i in mine if problems[i]]
    if todo and capture is None:
        named = ", ".join(f"{shard_name(i)} ({problems[i]})" for i in todo[:3]) + (", ..." if len(todo) > 3 else "")
        raise EyasError(f"eyas dump --finalize: {len(todo)} of {len(shards)} shards of the {label} split in {out_dir} "
                        f"are not done: {named}. The dump tasks that write them failed or have not run; run the "
                        "dump again (`eyas submit RECIPE --stage dump`, or `eyas dump RECIPE` where the target fits)")
    for i in todo:
        if problems[i] != "missing":
            print(f"eyas dump: redoing {out_dir / shard_name(i)}: {problems[i]}", flush=True)
        # No sidecar until the shard is rewritten: rank 0 must not index a shard being redone.
        (out_dir / shard_name(i).replace(".safetensors", ".json")).unlink(missing_ok=True)
    if todo:  # the dump is incomplete again until rank 0 rewrites the manifest
        (out_dir / MANIFEST).unlink(missing_ok=True)
    pending_tokens = int(sum(lengths[shards[i]].sum() for i in todo))
    done = len(mine) - len(todo)
    if rank == 0:
        print(f"eyas dump: {label}: {len(shards)} shards, {len(mine)} for this process "
              f"({done} already done), {pending_tokens} tokens to run", flush=True)
    progress = tqdm(total=pending_tokens, unit="tok", unit_scale=True, desc=f"dump {label}",
                    disable=rank != 0 or not pending_tokens, dynamic_ncols=True)
    metadata = {"schema_version": SCHEMA_VERSION, "plan": plan["fingerprint"]}
    # Batch rows go to the shard file on one thread while the next batch runs; a finished shard is
    # fsynced, hashed and renamed on another while the next shard runs. Neither holds a shard.
    with ThreadPoolExecutor(max_workers=1) as rows_thread, ThreadPoolExecutor(max_workers=1) as finish_thread:
        finishing: Future | None = None
        for i in todo:
            writer = ShardWriter(out_dir, i, lengths[shards[i]], shards[i], dict(metadata, shard=i))
            try:
                stream_rows(shard_batches(capture, dataset, shards[i], lengths[shards[i]], spec, dump_cfg.token_budget,
                                          vocab_size, device, progress), writer, rows_thread)
                if finishing is not None:
                    finishing.result()  # a failed finish stops the dump here, one shard later
            except BaseException:
                writer.abort()
                raise
            finishing = finish_thread.submit(writer.finish)
        if finishing is not None:
            finishing.result()
    progress.close()
    return list(range(len(shards)))


def finalize_split(out_dir: Path, num_shards: int, header: dict, wait: bool, plan: str | None = None) -> dict | None:
    """Rank 0: index + manifest once every shard exists (waiting for co-launched ranks).

    `plan`: the plan fingerprint every shard of this split carries (recorded as manifest `plan`)."""
    sidecars = [out_dir / shard_name(i).replace(".safetensors", ".json") for i in range(num_shards)]
    if wait:
        wait_for(sidecars)
    missing = [i for i in range(num_shards) if check_shard(out_dir, i, full=False)]
    if missing:
        print(f"eyas dump: {len(missing)} of {num_shards} shards in {out_dir} are written by other tasks; "
              "run `eyas dump RECIPE` once more as a single process after they finish to write the manifest",
              flush=True)
        return None
    records = [read_sidecar(out_dir, i) for i in range(num_shards)]
    index = build_index(out_dir, records)
    tokens = sum(r["num_tokens"] for r in records)
    shard_bytes = sum(r["bytes"] for r in records)
    manifest = dict(header)
    if plan is not None:
        manifest["plan"] = plan
    manifest.update(
        num_samples=sum(r["num_samples"] for r in records), num_tokens=tokens,
        num_loss_tokens=sum(r["num_loss_tokens"] for r in records), bytes=shard_bytes,
        bytes_per_token=shard_bytes / tokens if tokens else 0.0,
        anchor_bytes_per_token=4 * header["hidden_size"] * 2,
        shards=records, index=index,
    )
    manifest["ratio_to_anchor_layout"] = manifest["bytes_per_token"] / manifest["anchor_bytes_per_token"]
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest


# ----------------------------------------------------------------------------- the stage


def dump(recipe: Recipe, model: Any = None, tokenizer: Any = None, reverify: bool = False,
         finalize: bool = False) -> dict | None:
    """Run the stage; returns the train manifest (None on ranks/tasks that don't write it).

    `reverify`: hash every finished shard again (a rerun otherwise trusts them) and redo corrupt ones.
    `finalize`: one process writes the manifests and the vocabulary of shards that independent tasks
    (a SLURM array) wrote, loading the target's config and tokenizer but not its weights, so it needs
    no GPU; a shard still to write is refused."""
    rank, world, co_launched = (0, 1, False) if finalize else distributed_env()
    run_dir = recipe.run_dir
    splits = {"train": load_prepared(run_dir, "train"), "heldout": load_prepared(run_dir, "heldout")}
    backend = recipe.dump.backend
    model, tokenizer, config, device, backend_fields = backend_target(recipe, model, tokenizer, weights=not finalize)
    check_against_target(recipe, config)
    info = prepared_info(run_dir)
    if info.get("tokenizer_identity") != tokenizer_identity(tokenizer):
        raise EyasError(f"the prepared data in '{run_dir / 'prepared'}' was tokenised with another tokenizer or chat "
                        "template than the target's; rerun `eyas prepare RECIPE`")
    if device.type == "cpu" and world > 1 and co_launched:
        torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    spec = feature_spec(recipe, config)
    identity = target_identity(config, tokenizer)
    hidden = int(config.hidden_size)
    vocab_size = int(config.vocab_size)
    header = {
        "schema_version": SCHEMA_VERSION, "target_identity": identity, "identity_scheme": IDENTITY_SCHEME,
        "target_path": recipe.target.path,
        "model_type": config.model_type, "hidden_size": hidden, "num_hidden_layers": int(config.num_hidden_layers),
        "vocab_size": vocab_size, "draft_kind": recipe.draft.kind, "layers": spec["aux_layers"],
        "encoding": recipe.dump.encoding, "low_layer_encoding": recipe.dump.low_layer_encoding or recipe.dump.encoding,
        "teacher": recipe.dump.teacher, "topk": spec["topk"], "features": manifest_features(spec, hidden),
        **backend_fields,
    }
    root = run_dir / "shards"
    outputs = {"train": root, "heldout": root / "heldout"}
    plans = {}
    for split, dataset in splits.items():  # every split's plan checked before a vLLM engine starts
        settings = {k: header[k] for k in ("target_identity", "layers", "encoding", "low_layer_encoding",
                                           "teacher", "topk", "draft_kind")}
        settings.update(shard_tokens=recipe.dump.shard_tokens, token_budget=recipe.dump.token_budget)
        if backend != DEFAULT_BACKEND:  # the plans (and so the shards) of every earlier dump stay valid
            settings["backend"] = backend
        plan = dict(settings, data=data_fingerprint(dataset), num_samples=len(dataset))
        plan["fingerprint"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:20]
        plans[split] = plan
        check_plan(outputs[split], plan, rank)
    if world == 1:  # another process's writer may be alive on another node: only a lone process cleans up
        stale = remove_stale_temps(root)
        if stale:
            print(f"eyas dump: removed {len(stale)} temporary file(s) left by an interrupted run", flush=True)
    capture = None if finalize else make_capture(recipe, model, config, spec, splits, root / f".vllm-hidden-{rank}")
    counts = {}
    try:
        for split, dataset in splits.items():
            counts[split] = dump_split(dataset, outputs[split], plans[split], capture, spec, recipe.dump, vocab_size,
                                       device, rank, world, split, reverify=reverify)
    finally:
        if capture is not None:
            capture.close()
    if rank != 0:
        return None
    manifests = {}
    for split in ("heldout", "train"):  # train last: its manifest marks the whole dump as complete
        if split == "train":
            token_counts = count_tokens(splits["train"], vocab_size)
            header["vocab"] = write_vocab(root, token_counts, recipe.dump.draft_vocab_size)
        manifests[split] = finalize_split(outputs[split], len(counts[split]), header, wait=co_launched and world > 1,
                                          plan=plans[split]["fingerprint"])
    save_resolved(recipe, root)
    return manifests["train"]


def backend_target(recipe: Recipe, model: Any, tokenizer: Any,
                   weights: bool = True) -> tuple[Any, Any, Any, torch.device, dict]:
    """What `dump.backend` needs of the target before anything runs: (the transformers model, or None
    for vLLM, which loads its own, and without `weights`; the tokenizer; the config; the device
    features arrive on; the manifest fields naming the backend). vLLM's version is read first:
    without vLLM, one line before anything loads."""
    fields = {"backend": recipe.dump.backend}
    if recipe.dump.backend == "vllm":
        fields["vllm_version"] = vllm_version()
    if recipe.dump.backend == "vllm" or not weights:
        config = load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(recipe.target)
        return None, tokenizer, config, torch.device("cpu"), fields  # the engine's features arrive on the host
    if model is None:
        model, tokenizer = load_target(recipe.target)
    return model, tokenizer, model.config, next(model.parameters()).device, fields


def make_capture(recipe: Recipe, model: Any, config: Any, spec: dict, splits: dict, storage: Path) -> Any:
    """What runs the target for `dump.backend`: hooks on the transformers model, or a vLLM engine
    (`eyas.data.dump_vllm`) sized for the longest sample and writing its hidden states to `storage`."""
    if recipe.dump.backend != "vllm":
        return HiddenCapture(model, spec["aux_layers"])
    longest = max((int(sample_lengths(d).max()) for d in splits.values() if len(d)), default=1)
    dtype = resolve_dtype(recipe.target.dtype, pick_device(recipe.target.device))
    return VllmCapture(resolve_target_path(recipe.target.path), config, dtype, spec["aux_layers"], spec["last_hidden"],
                       recipe.dump, max_model_len=longest + 8, storage=storage, seed=recipe.run.seed)


def _report(manifest: dict | None, root: Path) -> None:
    if manifest is None:
        return
    print(f"eyas dump: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens in "
          f"{len(manifest['shards'])} shards, {manifest['bytes_per_token']:.0f} bytes/token "
          f"({manifest['ratio_to_anchor_layout']:.3f} of the 4 x hidden x 2 layout); "
          f"draft vocabulary {manifest['vocab']['draft_vocab_size']} tokens covering "
          f"{100 * manifest['vocab']['coverage']:.1f}% of loss tokens; wrote {root}")


def main(argv: list[str] | None = None) -> int:
    # command line only: the stage's library functions do not need the CLI helpers
    from eyas import stages
    from eyas.stage_cli import command_help, stage_main, stage_parser  # likewise

    # A flag, not a recipe key: the stage record would count a toggled key as a change of the
    # dump's settings and make the training behind it stale.
    parser = stage_parser("eyas dump", command_help("dump", __doc__))
    parser.add_argument("--reverify", action="store_true",
                        help="hash every finished shard again and redo corrupt ones (a rerun otherwise trusts shards "
                             "whose sidecar, size and header fit); runs the stage even if it is current")
    parser.add_argument("--finalize", action="store_true",
                        help="write the manifests and the draft vocabulary of shards that separate tasks (a SLURM "
                             "array) wrote, without loading the target's weights (no GPU needed); refuses if a "
                             "shard is missing. The `dump-finalize` job of `eyas submit` runs this")

    def body(recipe: Any, args: Any) -> None:
        stages.run("dump", recipe, lambda: _report(dump(recipe, reverify=args.reverify, finalize=args.finalize),
                                                   recipe.run_dir / "shards"),
                   force=args.force or args.reverify)

    return stage_main("dump", argv, body, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
