"""The trainer's data loader: token-budget batches of stored codes, read ahead by worker
processes, decoded on the device that trains on them.

Why codes: at 8B shapes one batch of 8192 tokens holds 3 x 4096 fused features and 4096 last
hidden per token, 134 MB as fp8 codes and 537 MB decoded to fp32. Decoding that on the CPU in
one thread (`accelerate launch` sets OMP_NUM_THREADS=1) and copying fp32 from pageable memory
is slower than a GPU step. Here the CPU side only slices and pads the stored tensors
(`ShardReader.codes`), in `train.loader_workers` processes; the batch crosses to the GPU as
codes from pinned memory (non_blocking) and `to_device` decodes it there with the very
`decode` that `ShardReader.sample` runs on the CPU, so the values are bitwise the same.

Order and resume: the batches are `TokenBudgetLoader`'s, in its order, whatever the number of
workers (a DataLoader keeps its sampler's order); `BatchStream` hands each with the loader
position *after* it, so a checkpoint resumes at the next batch however far the workers read
ahead. Errors: a shard error raised while reading (a corrupt byte, a foreign shard) travels
back from the worker as the item in place of its batch and is raised there, message unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eyas.data.batches import budget_batches
from eyas.data.shard_format import decode_sample, feature_parts
from eyas.errors import EyasError

STORED = "stored"  # batch key of the `Stored` note on a batch of codes (removed when decoded)
WORKER_IGNORED_SIGNALS = ("SIGTERM", "SIGUSR1")  # the trainer's stop signals: its checkpoint needs the workers
INT4_ZERO = 0x88  # two int4 codes of value 0 (stored + 8): padding that decodes to +0.0 like the rest


# ----------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Stored:
    """What a batch of codes needs to be decoded: the dump's manifest `features` and the dtype to decode to."""

    features: dict
    dtype: torch.dtype


def pad_batch(samples: list[dict[str, torch.Tensor]], fill: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad samples to the longest (with 0, or `fill[key]`); attention_mask marks real tokens.

    Unsigned 16-bit ids are widened to int32 (CUDA copies and converts few unsigned types)."""
    fill = fill or {}
    longest = max(s["input_ids"].numel() for s in samples)
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        first = samples[0][key]
        dtype = torch.int32 if first.dtype == torch.uint16 else first.dtype
        out = torch.full((len(samples), longest) + tuple(first.shape[1:]), fill.get(key, 0), dtype=dtype)
        for b, s in enumerate(samples):
            out[b, : s[key].shape[0]] = s[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros(len(samples), longest, dtype=torch.long)
    for b, s in enumerate(samples):
        batch["attention_mask"][b, : s["input_ids"].numel()] = 1
    return batch


def read_batch(reader: Any, indices: Any) -> dict:
    """The padded batch of samples `indices`: stored codes with a `Stored` note when the reader has
    them (`ShardReader`), else the reader's decoded samples (`PreparedReader`)."""
    if not hasattr(reader, "codes"):
        return pad_batch([reader.sample(int(i)) for i in indices])
    if hasattr(reader, "request"):  # a streamed reader: the batch's samples captured side by side
        reader.request(indices)
    features = reader.manifest["features"]
    fill = {name: INT4_ZERO for parts in feature_parts(features).values() for name, enc in parts if enc == "int4"}
    batch = pad_batch([reader.codes(int(i)) for i in indices], fill)
    batch[STORED] = Stored(features, reader.dtype)
    return batch


def decode_batch(batch: dict) -> dict:
    """A batch of codes decoded where its tensors are (a decoded batch is returned as it is)."""
    if STORED not in batch:
        return batch
    note: Stored = batch[STORED]
    rows, width = batch["attention_mask"].shape
    stored = {k: v.reshape(rows * width, *v.shape[2:]) for k, v in batch.items() if k not in (STORED, "attention_mask")}
    decoded = {k: v.reshape(rows, width, *v.shape[1:]) for k, v in decode_sample(stored, note.features, note.dtype).items()}
    decoded["attention_mask"] = batch["attention_mask"]
    return decoded


def to_device(batch: dict, device: torch.device) -> dict:
    """Move a batch to `device` and decode its codes there.

    From pinned memory the copies are asynchronous; the decode is queued after them on the same
    stream, and the caching host allocator keeps each pinned buffer until its copy is done."""
    moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return decode_batch(moved)


def stored_bytes(batch: dict) -> int:
    """Bytes of a batch's tensors (what crosses to the device)."""
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------- the order


class TokenBudgetLoader:
    """Padded batches of at most `token_budget` tokens, shuffled by (seed, epoch), split by rank.

    The epoch's order is built lazily, a window of samples at a time (the permutation, then each
    window sorted by length and cut into budget batches whose order is shuffled), so the first
    batch costs the same for any dataset size and padding stays small. The order does not depend
    on the number of processes. It is dealt in groups of `world_size x grad_accum` batches, one
    group per optimizer step: rank r takes group[r], group[r + world_size], ... (its micro-batches);
    an incomplete last group is dropped so every rank takes the same number of steps. So a step's
    global batch is the same batches for any split of the same group size (2 processes x 1 or
    1 process x 2), which is what lets a run resume on another number of processes.

    `state_dict()` is this rank's position (epoch, batches taken); iterating after
    `load_state_dict` continues exactly where the saved run stopped, also when it was saved by
    another number of processes with the same group size (the position is converted through the
    global count of batches taken, a whole number of groups at a step boundary).

    Iterating yields decoded CPU batches; the trainer reads the same order as codes through
    `BatchStream` (`plan()`), decoded on its device.
    """

    def __init__(self, reader: Any, token_budget: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, window: int = 2048, grad_accum: int = 1):
        if token_budget <= 0:
            raise EyasError(f"token_budget must be > 0, got {token_budget}")
        if not 0 <= rank < world_size:
            raise EyasError(f"rank {rank} is outside world_size {world_size}")
        self.reader, self.token_budget, self.seed = reader, int(token_budget), int(seed)
        self.rank, self.world_size, self.shuffle, self.window = rank, world_size, shuffle, int(window)
        self.grad_accum = int(grad_accum)
        self.epoch = 0
        self.position = 0  # batches this rank has taken in the current epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; the position restarts unless it is the epoch already under way."""
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def _rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, salt])

    def _global_batches(self) -> Iterator[np.ndarray]:
        """The epoch's batches (sample indices) for all ranks, in order, built one window at a time."""
        lengths = self.reader.lengths
        n = len(lengths)
        order = self._rng(0).permutation(n) if self.shuffle else np.arange(n)
        for w, start in enumerate(range(0, n, self.window)):
            chunk = order[start:start + self.window]
            chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
            batches = budget_batches(chunk, lengths, self.token_budget)
            if self.shuffle:
                batches = [batches[j] for j in self._rng(w + 1).permutation(len(batches))]
            yield from batches

    @property
    def group_size(self) -> int:
        """Batches per optimizer step over all ranks."""
        return self.world_size * self.grad_accum

    def _rank_batches(self) -> Iterator[np.ndarray]:
        group: list[np.ndarray] = []
        for batch in self._global_batches():
            group.append(batch)
            if len(group) == self.group_size:
                yield from group[self.rank::self.world_size]
                group = []

    def plan(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """The rest of this epoch for this rank as (epoch, position after the batch, sample indices),
        advancing the loader's position; the epoch moves on once it is exhausted."""
        skip = self.position
        for taken, indices in enumerate(self._rank_batches()):
            if taken < skip:
                continue  # resuming: index arithmetic only, no data is read
            self.position = taken + 1
            yield self.epoch, self.position, indices
        self.epoch, self.position = self.epoch + 1, 0  # a finished epoch moves on to the next order

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for _, _, indices in self.plan():
            yield decode_batch(read_batch(self.reader, indices))

    def __len__(self) -> int:
        """Batches this rank takes per epoch (walks the epoch's index plan: O(samples), no data read)."""
        return sum(1 for _ in self._rank_batches())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "token_budget": self.token_budget,
                "rank": self.rank, "world_size": self.world_size, "grad_accum": self.grad_accum,
                "group_size": self.group_size, "shuffle": self.shuffle, "window": self.window,
                "num_samples": len(self.reader)}

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position, converted when another number of processes saved it.

        A state written before positions recorded their group size is taken as this run's (it grouped
        by `world_size` alone: the same order except the last, incomplete group of an epoch)."""
        saved = {**state, "group_size": state.get("group_size", self.group_size)}
        for key in ("seed", "token_budget", "group_size", "shuffle", "window", "num_samples"):
            mine = len(self.reader) if key == "num_samples" else getattr(self, key)
            if key in saved and saved[key] != mine:
                raise EyasError(
                    f"cannot resume the data position: it was saved with {key}={saved[key]!r}, this run has "
                    f"{mine!r}; resume with the same settings and shards, or start a new run"
                )
        taken = int(state["position"]) * int(state.get("world_size", self.world_size))  # batches of all ranks
        if taken % self.world_size:
            raise EyasError(f"cannot resume the data position: {taken} batches were taken over all processes, which "
                            f"{self.world_size} process(es) cannot split evenly (the checkpoint is not at a step "
                            "boundary); resume with the number of processes that wrote it")
        self.epoch, self.position = int(state["epoch"]), taken // self.world_size


# ----------------------------------------------------------------------------- read-ahead


def endless_plan(loader: TokenBudgetLoader) -> Iterator[tuple[int, int, np.ndarray] | EyasError]:
    """`loader.plan()` epoch after epoch; ends with an EyasError item when two epochs running yield no
    batch for this rank (one is normal: resuming at the end of an epoch), instead of looping forever."""
    empty_epochs = 0
    while True:
        produced = 0
        for item in loader.plan():
            produced += 1
            yield item
        empty_epochs = 0 if produced else empty_epochs + 1
        if empty_epochs >= 2:
            yield EyasError("the training data yields no batch for this process (fewer batches than processes?); "
                            "use more data, a smaller train.token_budget or fewer processes")
            return


def asked_ahead(planned: Iterator, reader: Any) -> Iterator:
    """The plan's items, with the samples of the batches ahead asked of a streamed reader (`eyas.train.stream`) up to
    its window: the engines capture ahead of the batch being read, the samples of at most `reader.window` ahead."""
    ahead: collections.deque = collections.deque()
    held = 0  # samples in the batches asked and not yet handed on
    for item in planned:
        if isinstance(item, EyasError):
            break
        reader.request(item[2])
        ahead.append(item)
        held += len(item[2])
        while ahead and held >= reader.window:
            held -= len(ahead[0][2])
            yield ahead.popleft()
    else:
        item = None
    yield from ahead
    if item is not None:
        yield item


class _Plan:
    """The DataLoader's sampler: iterated in the training process, so the order is the loader's."""

    def __init__(self, loader: TokenBudgetLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator:
        return endless_plan(self.loader)


class BatchReads(Dataset):
    """One planned batch read as codes: (batch, epoch, position, sample indices), or the EyasError that stopped it.

    Errors are returned, not raised: a DataLoader re-raises a worker's exception with the worker's
    traceback folded into its message, and a user-facing error must stay one line."""

    def __init__(self, reader: Any, decode: bool = False) -> None:
        self.reader, self.decode = reader, decode

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, EyasError):
            return item
        epoch, position, indices = item
        try:
            batch = read_batch(self.reader, indices)
            return (decode_batch(batch) if self.decode else batch), epoch, position, indices
        except EyasError as exc:
            return exc


def _stop_signals() -> set[signal.Signals]:
    return {getattr(signal, name) for name in WORKER_IGNORED_SIGNALS if hasattr(signal, name)}


def _ignore_stop_signals(_worker_id: int) -> None:
    """Workers outlive SIGTERM/SIGUSR1 (Slurm signals every process of the job): the trainer answers
    them with a checkpoint at the next step, which needs its batches; workers end when the stream
    closes or, failing that, when the training process is gone (DataLoader's watchdog).

    A worker starts with these signals blocked (`_workers_started`), so one that lands before this
    runs stays pending and is discarded here rather than killing the worker half-started."""
    for number in _stop_signals():
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _stop_signals())


@contextlib.contextmanager
def _workers_started() -> Iterator[None]:
    """Block the stop signals in this thread while worker processes start (they inherit the mask); a
    signal to the trainer meanwhile is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _stop_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _pinned(item: Any) -> Any:
    if isinstance(item, tuple):
        batch, *rest = item
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, *rest
    return item


class BatchStream:
    """Endless batches of codes over epochs from a TokenBudgetLoader, read ahead.

    Yields (batch, position): `position` is the loader state *after* this batch, so a checkpoint
    taken after consuming it resumes at the next one, whatever has already been read ahead.
    `to_device` decodes a batch on the training device. An epoch that yields no batch for this
    rank twice running is an error (it would loop forever).

    `workers` > 0: a torch DataLoader whose worker processes read the batches (up to `prefetch`
    each ahead), in the loader's order; one endless pass over the epochs, so workers live as long
    as the stream (never restarted at an epoch boundary, which would also drain the read-ahead).
    `workers` 0: one thread of this process reads `prefetch` batches ahead (`prefetch` 0: read at
    the call). `pin_memory` (default: when CUDA is available) puts batches in page-locked memory,
    so the copy to the GPU is asynchronous. `decode_in_reader`: the readers decode too (for a CPU
    trainer, whose batch goes nowhere: the decode then overlaps the step instead of adding to it).
    """

    def __init__(self, loader: TokenBudgetLoader, prefetch: int = 2, workers: int = 0,
                 pin_memory: bool | None = None, decode_in_reader: bool = False) -> None:
        self.loader = loader
        # a streamed reader's captures are threads of this process, which worker processes could not share
        self.prefetch, self.workers = int(prefetch), 0 if hasattr(loader.reader, "request") else int(workers)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._reads = BatchReads(loader.reader, decode=decode_in_reader)
        self.taken = np.zeros(len(loader.reader), dtype=np.int64)  # times each sample was handed on (to a step)
        self._source: Iterator | None = None
        self._data: Any = None  # the DataLoader's iterator (workers > 0)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_in_process(self) -> Iterator:
        planned_batches = endless_plan(self.loader)
        if hasattr(self.loader.reader, "request"):
            planned_batches = asked_ahead(planned_batches, self.loader.reader)
        for planned in planned_batches:
            item = self._reads[planned]
            yield _pinned(item) if self.pin_memory else item
            if isinstance(item, EyasError):
                return

    def _start(self) -> Iterator:
        if self.workers > 0:
            # The workers' seeds come from a generator of the stream's own: by default the DataLoader draws
            # them from the global torch RNG when the iterator is made, after a resume restored that RNG,
            # so a resumed run's random state would be one draw past an uninterrupted run's.
            seeds = torch.Generator().manual_seed(self.loader.seed)
            with _workers_started():
                self._data = iter(DataLoader(self._reads, batch_size=None, sampler=_Plan(self.loader),
                                             num_workers=self.workers, prefetch_factor=max(1, self.prefetch),
                                             pin_memory=self.pin_memory, worker_init_fn=_ignore_stop_signals,
                                             generator=seeds))
            return self._data
        if self.prefetch <= 0:
            return self._read_in_process()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._fill, name="eyas-prefetch", daemon=True)
        self._thread.start()
        return iter(self._queue.get, None)

    def _fill(self) -> None:
        try:
            for item in self._read_in_process():
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put(exc)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[dict, dict]:
        if self._source is None:
            self._source = self._start()
        item = next(self._source)
        if isinstance(item, BaseException):
            raise item
        batch, epoch, position, indices = item
        self.taken[np.asarray(indices)] += 1
        return batch, {**self.loader.state_dict(), "epoch": epoch, "position": position}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._data is not None:
            self._data._shutdown_workers()  # DataLoader has no public close; its __del__ calls this too
            self._data = None


def make_loader(recipe: Any, accelerator: Any, reader: Any, shuffle: bool) -> TokenBudgetLoader:
    return TokenBudgetLoader(reader, recipe.train.token_budget, seed=recipe.run.seed, rank=accelerator.process_index,
                             world_size=accelerator.num_processes, shuffle=shuffle, grad_accum=recipe.train.grad_accum)
