"""Many prompts at once: the speculative decoder over a batch of rows with ragged acceptance.

One round verifies every live row in ONE target forward (B rows x K+1 tokens); on a CPU the
target is weight-memory bound at small token counts, so that forward costs far less than B
forwards of K+1 tokens, and an eval of a prompt set costs about what its longest prompts cost.

Layout (`RaggedCache`): one HF DynamicCache [B, H, S, D] for the batch; row b's entries are
the contiguous columns [start_b, start_b + len_b), column c at RoPE position c - start_b.
Prompts are left-padded for the prefill (so the last prompt token of every row sits in the
last column and only its logits are computed); later tokens are appended at columns S..S+n
for all rows, then each row keeps its own count of them (`settle`: moved next to its own
entries, the rest dropped), so the cache grows by what each row accepted, not by the padding.
Every forward gets an additive 4D mask [B, 1, n, S + n] that hides each row's padding and
stale columns; finished rows (EOS or max tokens) leave the batch (`select`). A target (or a
truncated-target draft) with sliding-window layers gets their masks too, which also hide keys
`sliding_window` or more positions behind the query, in each row's own positions
(`eyas.eval.kv.layer_masks`); the cache keeps every layer's full history, as one at a time.

Per round and row the steps are those of `SpeculativeDecoder`: draw the row's tree from the draft with
the row's own generator, verify with `verify_greedy` / `verify_sampled`, count with the same
bookkeeping, so each row's `DecodeResult` means what it means one at a time. The verify runs every
row's tree in one forward (right-padded to the largest, each node at its root's position + its depth,
seeing its row's entries, its ancestors and itself), and each row keeps its root and accepted path
(`RaggedCache.keep`). With the same per-row seed a row draws its random numbers in the same order as a
fresh `SpeculativeDecoder(seed=...)` on that prompt alone, so outputs and acceptance counts agree with
the one-at-a-time decoder up to float rounding: a batch changes matmul blocking and adds masked columns
to each softmax, which can move a last bit (fp32: never a token in the tests; bf16: a near-tie can flip,
as between a verify and single steps, see `eval.kv`).

How the rows draft (`TogetherDrafts`): every row builds its tree (a chain is a tree of one branch) in
lockstep with the others: each row's builder (`eyas.eval.tree.tree_steps`) asks for its nodes of one
depth, and every row's nodes of that depth run in ONE draft forward through the draft's batched adapter:
token drafts (`LMDraft`, e.g. truncated:N) and the shared-layer heads (eagle, eagle3) see their row's
committed entries, their ancestors and themselves (`TreeNodes`); peagle's mask slots and dflash's block
run once per round for every row; an mtp head runs layer d for every row's depth-d nodes
(`BatchedPerStepDraft`); `BATCHED` names each drafting layout's adapter. So a round's draft forwards do
not grow with the batch (docs/results.md, "Many prompts at once").
The mixture test draft runs one prompt at a time (`batch_unsupported`).
"""

from __future__ import annotations

import torch

from eyas.decode import SamplingParams, cache_kwarg, new_cache, process_logits, sample, stop_token_ids
from eyas.draft.layouts import BLOCK, LAYER_PER_STEP, PARALLEL_SLOTS, SHARED_LAYER, Layout
from eyas.errors import EyasError
from eyas.eval.decoder import DecodeResult, SpeculativeDecoder, _Clock, _count, _cut, drafted_path
from eyas.eval.drafts import LMDraft, MixtureDraft
from eyas.eval.head_draft import (
    BlockDraft,
    HeadDraft,
    PerStepDraft,
    SharedLayerDraft,
    chain_confidence,
    mask_slot_inputs,
)
from eyas.eval.kv import check_attention, layer_masks, row_invariant_attention
from eyas.eval.tree import Expansion, Tree, confident_chain, tree_steps
from eyas.eval.verify import verify_greedy, verify_sampled
from eyas.shapes import Shape

# --------------------------------------------------------------------------------------------
# The ragged cache


class RaggedCache:
    """A batch KV cache whose row b holds columns [start_b, start_b + len_b) (see the module docstring)."""

    def __init__(self, rows: int = 0) -> None:
        """An empty cache (`rows`: for appending to at once, without a prefill)."""
        self.cache = new_cache()
        self.start = torch.zeros(rows, dtype=torch.long)
        self.lengths = torch.zeros(rows, dtype=torch.long)

    @property
    def width(self) -> int:
        """Physical columns (every row's entries end at or before it)."""
        return int((self.start + self.lengths).max()) if len(self.lengths) else 0

    def prefill_mask(self, counts: torch.Tensor, dtype: torch.dtype, device, config=None):
        """Additive [B, 1, W, W] for left-padded rows of `counts` tokens in an empty cache: causal, padding hidden
        (`config`: a model with sliding-window layers gets their masks too, see `_masks`)."""
        width = int(counts.max())
        cols = torch.arange(width)
        start = width - counts
        visible = (cols[None, :] <= cols[:, None])[None] & (cols[None, None, :] >= start[:, None, None])
        return _masks(config, visible, (cols[:, None] - cols[None, :])[None], dtype, device)

    def prefill_positions(self, counts: torch.Tensor) -> torch.Tensor:
        width = int(counts.max())
        return (torch.arange(width)[None, :] - (width - counts)[:, None]).clamp(min=0)

    def after_prefill(self, counts: torch.Tensor) -> None:
        self.start = int(counts.max()) - counts
        self.lengths = counts.clone()

    def append_mask(self, n: int, counts: torch.Tensor, dtype: torch.dtype, device, config=None,
                    within: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    history: torch.Tensor | None = None):
        """Additive [B, 1, n, S + n] for n new tokens per row (`config`: as in `prefill_mask`). `within` [B, n, n]
        (bool): which new tokens each new token sees, by default causal among the first counts_b (a tree: each
        node's ancestors and itself); `positions` [B, n]: theirs, by default `append_positions(n)`; `history`
        [B, n, L] (bool): which of its row's entries (0..len_b-1) each new token sees, by default all."""
        cols = torch.arange(self.width)
        own = cols[None, :] - self.start[:, None]  # [B, S]: the index of column c among row b's entries
        old = ((own >= 0) & (own < self.lengths[:, None]))[:, None, :].expand(-1, n, -1)
        if history is not None:
            index = own.clamp(0, history.shape[2] - 1)[:, None, :].expand(-1, n, -1)
            old = old & torch.gather(history, 2, index)
        if within is None:
            new = torch.arange(n)
            within = (new[None, :] <= new[:, None])[None] & (new[None, None, :] < counts[:, None, None])
        visible = torch.cat([old, within], dim=2)
        query = self.append_positions(n) if positions is None else positions  # row b's column c: position c - start_b
        keys = torch.cat([own, query], dim=1)
        return _masks(config, visible, query[:, :, None] - keys[:, None, :], dtype, device)

    def append_positions(self, n: int, depths: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n] positions of n new tokens per row: each row's next position + 0..n-1, or + `depths` [B, n] (a
        tree node sits at its root's position + its depth)."""
        return self.lengths[:, None] + (torch.arange(n)[None, :] if depths is None else depths)

    def settle(self, counts: torch.Tensor) -> None:
        """After a forward appended n columns at S: row b keeps its first counts_b, moved next to its entries."""
        self.keep([list(range(int(c))) for c in counts])

    def keep(self, offsets: list[list[int]]) -> None:
        """After a forward appended columns at S: row b keeps the appended columns S + offsets_b (ascending: a
        tree's root and accepted path), moved next to its entries; the rest are dropped."""
        width = self.width
        self._move(offsets, torch.full_like(self.start, width), self.start + self.lengths)

    def compact(self, first: torch.Tensor, offsets: list[list[int]]) -> None:
        """Row b keeps its first `first_b` entries and then its entries first_b + offsets_b (ascending: the
        accepted tree nodes a draft ran); the rest are dropped."""
        self.lengths = first.clone()
        self._move(offsets, self.start + first, self.start + first)

    def _move(self, offsets: list[list[int]], source: torch.Tensor, target: torch.Tensor) -> None:
        """Row b's columns source_b + offsets_b move to target_b, target_b + 1, ... (target_b <= source_b),
        its entries grow by len(offsets_b), and columns no row uses are cropped."""
        counts = torch.tensor([len(o) for o in offsets], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(offsets)), counts)
        src = source[rows] + torch.tensor([o for row in offsets for o in row], dtype=torch.long)
        ranks = torch.cat([torch.arange(int(c)) for c in counts]) if len(rows) else rows
        dst = target[rows] + ranks
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or keys.numel() == 0:
                continue
            r, s, d = rows.to(keys.device), src.to(keys.device), dst.to(keys.device)
            keys[r, :, d] = keys[r, :, s]  # the right side is gathered first, and d <= s: overlapping moves are safe
            values[r, :, d] = values[r, :, s]
        self.lengths = self.lengths + counts
        self._crop()

    def truncate(self, lengths: torch.Tensor) -> None:
        """Row b keeps its first lengths_b entries."""
        self.lengths = lengths.clone()
        self._crop()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished ones leave the batch)."""
        filled = [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
        if filled:  # (an mtp layer's cache holds only its own layer)
            self.cache.batch_select_indices(rows.to(filled[0].keys.device))
        self.start, self.lengths = self.start[rows], self.lengths[rows]
        shift = int(self.start.min()) if len(rows) else 0  # columns no remaining row uses
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() and shift:
                layer.keys, layer.values = layer.keys[..., shift:, :], layer.values[..., shift:, :]
        self.start = self.start - shift
        self._crop()

    def last_column(self) -> torch.Tensor:
        return self.start + self.lengths - 1

    def _crop(self) -> None:
        width = self.width
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., :width, :], layer.values[..., :width, :]


def _masks(config, visible: torch.Tensor, distance: torch.Tensor, dtype: torch.dtype, device):
    """The additive mask of bool `visible` [B, n, S]; for a model with sliding-window layers (`config` given) the
    per-layer-type masks of `eyas.eval.kv.layer_masks`, `distance` [B, n, S] being each query's distance to each
    key in positions. A draft head's own layers attend in full (`config=None`)."""
    if config is None:
        return _additive(visible, dtype, device)
    return layer_masks(config, visible, distance, lambda v: _additive(v, dtype, device))


def _additive(visible: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    return torch.where(visible, zero, blocked)[:, None].to(device)


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(counts.max())
    return torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.long), counts


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(counts.max())
    return torch.tensor([[r[0]] * (width - len(r)) + r for r in rows], dtype=torch.long), counts


def _pick(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] -> x[b, columns_b] [B, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), columns.to(x.device)]


# --------------------------------------------------------------------------------------------
# Batched drafts: start / expand (every row's tree nodes of one depth) / commit (ragged) / select

Requests = list[Expansion | None]
"""One lockstep step: per row, the expansion its tree builder asks for (`eyas.eval.tree.tree_steps`), or None."""


class TreeNodes:
    """Each row's draft tree this round, by the draft's node id (0, 1, ... from the last start or commit, as one
    at a time): every node's bitset of itself and its ancestors, and its depth."""

    def __init__(self, rows: int):
        self.bits: list[list[int]] = [[] for _ in range(rows)]
        self.depths: list[list[int]] = [[] for _ in range(rows)]

    def add(self, requests: Requests) -> int:
        """Number the requested nodes; returns their depth (in lockstep every request is one depth deep)."""
        depths = set()
        for bits, row_depths, request in zip(self.bits, self.depths, requests):
            for parent in request[0] if request else ():
                bits.append((1 << len(bits)) | (bits[parent] if parent >= 0 else 0))
                row_depths.append(row_depths[parent] + 1 if parent >= 0 else 1)
                depths.add(row_depths[-1])
        if len(depths) != 1:
            raise EyasError(f"batched drafting expands one depth at a time; the rows asked for depths {sorted(depths)}")
        return depths.pop()

    def inputs(self, requests: Requests, committed: torch.Tensor, depth: int):
        """The new nodes as a right-padded batch: (ids [B, n], counts [B], positions [B, n], within [B, n, n],
        history [B, n, L]). Row b's cache holds its committed_b entries, then its earlier nodes by id; a node
        sits at its root's position + its depth (the root is entry committed_b - 1) and sees the committed
        entries, its ancestors and itself (padding: the committed entries and itself)."""
        counts = torch.tensor([len(r[1]) if r else 0 for r in requests], dtype=torch.long)
        n = max(int(counts.max()), 1)
        ids = torch.zeros(len(requests), n, dtype=torch.long)
        history = torch.zeros(len(requests), n, int((committed + torch.tensor([len(b) for b in self.bits])).max()),
                              dtype=torch.bool)
        for b, request in enumerate(requests):
            history[b, :, :int(committed[b])] = True
            if not request:
                continue
            ids[b, :len(request[1])] = torch.tensor(request[1])
            first = len(self.bits[b]) - len(request[1])
            for j, bits in enumerate(self.bits[b][first:]):
                history[b, j, int(committed[b]) + torch.tensor([i for i in range(first) if bits >> i & 1],
                                                               dtype=torch.long)] = True
        positions = (committed - 1 + depth)[:, None].expand(-1, n)
        within = torch.eye(n, dtype=torch.bool)[None].expand(len(requests), -1, -1)
        return ids, counts, positions, within, history


def _each_node(logits: torch.Tensor, requests: Requests) -> list[torch.Tensor | None]:
    """Row b's logits [B, V] for every node it asked to expand (a mask slot: one per depth)."""
    return [logits[b, None].expand(len(r[0]), -1) if r else None for b, r in enumerate(requests)]


def _rows(logits: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor | None]:
    """Per row, the logits of its first counts_b new nodes (None for a row without any)."""
    return [logits[b, :c] if c else None for b, c in enumerate(counts.tolist())]


class BatchedLMDraft:
    """A token-only draft (`LMDraft`, e.g. truncated:N) over a `RaggedCache`. As one at a time, tree nodes run with
    their tree mask (no sliding window: `LMDraft.expand`'s mask) and the accepted nodes it ran keep their entries."""

    feature_layers = None
    max_depth = None

    def __init__(self, draft: LMDraft):
        self.model = draft.model
        self.name = draft.name
        self.vocab_size = draft.vocab_size
        self._cache_kw = cache_kwarg(self.model)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        device = self.model.device
        out = self.model(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask,
                         use_cache=True, **{self._cache_kw: self.kv.cache})
        return out.logits.float()

    def start(self, prompts: list[list[int]], roots: list[int], features=None) -> torch.Tensor:
        self.kv = RaggedCache()
        ids, counts = _left_padded([p + [r] for p, r in zip(prompts, roots)])
        logits = self._forward(ids, self.kv.prefill_positions(counts),
                               self.kv.prefill_mask(counts, self.model.dtype, self.model.device, self.model.config))
        self.kv.after_prefill(counts)
        self.committed, self.nodes = counts.clone(), TreeNodes(len(roots))
        return logits[:, -1]

    def expand(self, requests: Requests) -> list[torch.Tensor | None]:
        depth = self.nodes.add(requests)
        ids, counts, positions, within, history = self.nodes.inputs(requests, self.committed, depth)
        mask = self.kv.append_mask(ids.shape[1], counts, self.model.dtype, self.model.device, within=within,
                                   positions=positions, history=history)
        logits = self._forward(ids, positions, mask)
        self.kv.settle(counts)
        return _rows(logits, counts)

    def commit(self, kept: list[list[int]], accepted: list[list[int]], roots: list[int], features=None):
        self.kv.compact(self.committed, kept)
        ids, counts = _right_padded([a[len(k):] + [r] for a, k, r in zip(accepted, kept, roots)])
        n = ids.shape[1]
        logits = self._forward(ids, self.kv.append_positions(n),
                               self.kv.append_mask(n, counts, self.model.dtype, self.model.device, self.model.config))
        self.kv.settle(counts)
        self.committed, self.nodes = self.kv.lengths.clone(), TreeNodes(len(roots))
        return _pick(logits, counts - 1)

    def select(self, rows: torch.Tensor) -> None:
        self.kv.select(rows)
        self.committed = self.committed[rows]


def _take_head(adapter, draft) -> None:
    """What a batched head adapter takes from its one-at-a-time draft: the draft protocol's attributes, the head,
    its dtype and device (the adapter calls the draft's own `_project` and `_to_target`)."""
    adapter.draft, adapter.head, adapter.name, adapter.vocab_size = draft, draft.head, draft.name, draft.vocab_size
    adapter.feature_layers, adapter.max_depth, adapter.device = draft.feature_layers, draft.max_depth, draft.device
    adapter.dtype = next(draft.head.parameters()).dtype


class BatchedSharedLayerDraft:
    """eagle / eagle3 (`SharedLayerDraft`) over a `RaggedCache`: slot t holds (f_t, x_{t+1}) at position t; a tree
    node at depth d is step d with its parent's hidden, attending to the committed slots, its ancestors and
    itself."""

    def __init__(self, draft: SharedLayerDraft, depth: int):
        _take_head(self, draft)
        self.slots = depth - 1  # a tree `depth` deep expands its nodes at depths 1..depth-1

    def _step(self, k: int, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        return self.head.step(k, ids.to(self.device), features, positions.to(self.device), attention_mask=mask,
                              past_key_values=self.kv.cache)

    def start(self, prompts: list[list[int]], roots: list[int], features: torch.Tensor) -> torch.Tensor:
        """features: the target's left-padded prefill features [B, W, F] (W = the longest prompt)."""
        self.kv = RaggedCache()
        ids, counts = _left_padded([p[1:] + [r] for p, r in zip(prompts, roots)])
        hidden, logits = self._step(0, ids, self.draft._project(features), self.kv.prefill_positions(counts),
                                    self.kv.prefill_mask(counts, self.dtype, self.device))
        self.kv.after_prefill(counts)
        self._committed(hidden[:, -1])
        return self.draft._to_target(logits[:, -1])

    def _committed(self, root_hidden: torch.Tensor) -> None:
        self.committed, self.root_hidden = self.kv.lengths.clone(), root_hidden
        self.nodes, self.hidden = TreeNodes(len(root_hidden)), [[] for _ in range(len(root_hidden))]
        self.slot_logits = None

    def expand(self, requests: Requests) -> list[torch.Tensor | None]:
        depth = self.nodes.add(requests)
        ids, counts, positions, within, history = self.nodes.inputs(requests, self.committed, depth)
        hidden, logits = self._step(depth, ids, self._parent_hidden(requests, ids.shape[1]), positions,
                                    self.kv.append_mask(ids.shape[1], counts, self.dtype, self.device, within=within,
                                                        positions=positions, history=history))
        self.kv.settle(counts)
        for b, c in enumerate(counts.tolist()):
            self.hidden[b] += list(hidden[b, :c])
        return [self.draft._to_target(x) if x is not None else None for x in _rows(logits, counts)]

    def _parent_hidden(self, requests: Requests, n: int) -> torch.Tensor:
        """[B, n, H]: each new node's parent's hidden (the root's for its children, and for padding)."""
        rows = []
        for b, request in enumerate(requests):
            own = [self.hidden[b][p] if p >= 0 else self.root_hidden[b] for p in (request[0] if request else [])]
            rows.append(torch.stack(own + [self.root_hidden[b]] * (n - len(own))))
        return torch.stack(rows)

    def commit(self, kept: list[list[int]], accepted: list[list[int]], roots: list[int],
               features: list[torch.Tensor]) -> torch.Tensor:
        # tree entries were made from draft features: drop them, recompute the accepted pairs as step 0
        self.kv.truncate(self.committed)
        ids, counts = _right_padded([a + [r] for a, r in zip(accepted, roots)])
        n = ids.shape[1]
        padded = torch.stack([torch.cat([f, f[-1:].expand(n - len(f), -1)]) for f in features])
        hidden, logits = self._step(0, ids, self.draft._project(padded), self.kv.append_positions(n),
                                    self.kv.append_mask(n, counts, self.dtype, self.device))
        self.kv.settle(counts)
        self._committed(_pick(hidden, counts - 1))
        return self.draft._to_target(_pick(logits, counts - 1))

    def select(self, rows: torch.Tensor) -> None:
        self.kv.select(rows)
        self.committed = self.committed[rows]
        self.root_hidden = self.root_hidden[rows.to(self.root_hidden.device)]


class BatchedParallelSlotsDraft(BatchedSharedLayerDraft):
    """peagle (`ParallelSlotsDraft`): the shared layer's batch, its mask slots for depths 1..depth-1 run in one
    forward at depth 1."""

    def expand(self, requests: Requests) -> list[torch.Tensor | None]:
        return self._mask_slots(requests, self.nodes.add(requests))

    def _mask_slots(self, requests: Requests, depth: int) -> list[torch.Tensor | None]:
        """Every depth-d node of a row has its row's depth-d mask slot logits; at depth 1 every depth's slots run
        in one forward (`ParallelSlotsDraft`)."""
        if self.slot_logits is None:
            n = max(self.slots, 1)
            rows = len(requests)
            ids, feature = mask_slot_inputs(self.head, self.root_hidden, n)
            counts = torch.full((rows,), n, dtype=torch.long)
            _, logits = self._step(1, ids, feature, self.kv.append_positions(n),
                                   self.kv.append_mask(n, counts, self.dtype, self.device))
            self.kv.settle(counts)
            self.slot_logits = logits
        return _each_node(self.draft._to_target(self.slot_logits[:, depth - 1]), requests)


class BatchedBlockDraft:
    """dflash, dspark (`BlockDraft`) over a batch. Each row keeps its own context keys and values per layer (the
    target's features of its committed tokens, at their positions). A round's blocks, one per row, run in
    ONE forward as the blocks of one sequence whose context is every row's, each block seeing only its own
    row's columns (`BlockHead.block_rows` takes a visibility row per block); predicting row d of row b's block
    and a node's own token give the logits of that depth-(d+1) node's children, as `BlockDraft` gives them
    one row at a time."""

    def __init__(self, draft: BlockDraft, depth: int):
        _take_head(self, draft)

    def _context(self, features: torch.Tensor, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (keys, values) [1, heads, n, dim] of one row's target features [n, F] from position `start`."""
        projected = self.draft._project(features)
        return self.head.context(projected[None], torch.arange(start, start + len(projected), device=self.device))

    def start(self, prompts: list[list[int]], roots: list[int], features: torch.Tensor) -> torch.Tensor:
        """features: the target's left-padded prefill features [B, W, F] (W = the longest prompt)."""
        width = features.shape[1]
        self.contexts = [self._context(features[b, width - len(p):], 0) for b, p in enumerate(prompts)]
        self.positions = [len(p) for p in prompts]  # each row's root position
        return self._blocks(roots)

    def expand(self, requests: Requests) -> list[torch.Tensor | None]:
        depth = self.nodes.add(requests)
        if depth >= self.max_depth:
            raise EyasError(f"the {self.draft.kind} draft drafts {self.max_depth} tokens per block: shapes deeper "
                            f"than {self.max_depth} cannot be drafted with it")
        counts = [len(r[1]) if r else 0 for r in requests]
        rows = torch.cat([self.rows[b, depth, None].expand(c, -1) for b, c in enumerate(counts)])
        tokens = torch.tensor([t for r in requests if r for t in r[1]], device=self.device)
        logits = self.draft._to_target(self.head.slot_logits(rows, tokens))
        return [part if c else None for part, c in zip(logits.split(counts), counts)]

    def commit(self, kept: list[list[int]], accepted: list[list[int]], roots: list[int],
               features: list[torch.Tensor]) -> torch.Tensor:
        """features[b]: row b's target features at its old root and accepted tokens, added to its context."""
        for b, row in enumerate(features):
            added = self._context(row, self.positions[b])
            self.contexts[b] = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                                for (k, v), (nk, nv) in zip(self.contexts[b], added)]
            self.positions[b] += len(accepted[b]) + 1
        return self._blocks(roots)

    def _blocks(self, roots: list[int]) -> torch.Tensor:
        """Every row's block after its root in one forward; keeps the predicting rows, returns the logits of each
        row's root's children."""
        context = [tuple(torch.cat([row[layer][i] for row in self.contexts], dim=2) for i in (0, 1))
                   for layer in range(len(self.contexts[0]))]
        lengths = torch.tensor([row[0][0].shape[2] for row in self.contexts])
        ends = lengths.cumsum(0)
        columns = torch.arange(int(ends[-1]))
        visible = (columns[None, :] >= (ends - lengths)[:, None]) & (columns[None, :] < ends[:, None])
        anchors = torch.tensor(roots, device=self.device)
        self.roots = list(roots)
        self.rows = self.head.block_rows(anchors[None], torch.tensor(self.positions, device=self.device), context,
                                         visible.to(self.device), self.max_depth)[0]  # [B, K, H]
        self.nodes = TreeNodes(len(roots))
        return self.draft._to_target(self.head.slot_logits(self.rows[:, 0], anchors))

    def select(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.contexts = [self.contexts[b] for b in keep]
        self.positions = [self.positions[b] for b in keep]
        self.roots = [self.roots[b] for b in keep]
        self.rows = self.rows[rows.to(self.rows.device)]

    def chain_confidence(self, row: int, tokens: list[int]) -> list[float]:
        """`BlockDraft.chain_confidence` of row `row`'s chain."""
        return chain_confidence(self.head, self.rows[row], self.roots[row], tokens)


class BatchedPerStepDraft:
    """mtp (`PerStepDraft`) over a batch. Layer k keeps its own `RaggedCache`: row b's entries are its slots whose
    token x_{s+k+1} is committed, at positions s + k. A depth-d node runs layer d over slots M-d..M-1 with its
    path's tokens standing in for the unknown ones; every row's depth-d nodes run in ONE forward, each node's
    rows seeing layer d's committed entries and, causally, each other (not another node's), and they leave
    nothing in the cache, as one at a time. Commits advance every layer over its newly known slots, each
    layer one forward for every row."""

    def __init__(self, draft: PerStepDraft, depth: int):
        _take_head(self, draft)

    def start(self, prompts: list[list[int]], roots: list[int], features: torch.Tensor) -> torch.Tensor:
        """features: the target's left-padded prefill features [B, W, F] (W = the longest prompt)."""
        width = features.shape[1]
        self.tokens = [p + [r] for p, r in zip(prompts, roots)]  # row b: x_0 .. x_M
        self.features = [self.draft._project(features[b, width - len(p):]) for b, p in enumerate(prompts)]
        self.kv = [RaggedCache(len(prompts)) for _ in range(self.max_depth)]
        self.frontier = [[0] * self.max_depth for _ in prompts]  # per row and layer: committed slots
        self.real_hidden: list[list[torch.Tensor | None]] = [[None] * self.max_depth for _ in prompts]
        self.nodes: list[list[dict]] = [[] for _ in prompts]  # per row, by node id: its path, hidden rows
        self.tree = TreeNodes(len(prompts))
        return self._advance()

    def _feature(self, b: int, layer: int, slots: range, parent: dict | None = None) -> torch.Tensor:
        """Row b's features of `layer` at `slots`, as `PerStepDraft._feature` gives them one row at a time."""
        target = self.features[b][slots.start:slots.stop]
        if layer == 0:
            return target
        known = self.frontier[b][layer - 1]
        previous = torch.stack([self.real_hidden[b][layer - 1][s] if s < known
                                else parent["hidden"][s - parent["first_slot"]] for s in slots])
        return self.head.next_feature(previous, target)

    def _run(self, layer: int, rows: list[list[tuple[list[int], torch.Tensor, list[int]]]]):
        """Layer `layer` over per-row pieces (tokens, features [n, H], positions), right-padded into one forward
        after the layer's entries, each piece causal among its own rows only: (hidden, logits) [B, n, ...] and
        the rows' counts."""
        sizes = [[len(tokens) for tokens, _, _ in row] for row in rows]
        counts = torch.tensor([sum(row) for row in sizes], dtype=torch.long)
        n = max(int(counts.max()), 1)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        positions = torch.zeros(len(rows), n, dtype=torch.long)
        feats = torch.zeros(len(rows), n, self.features[0].shape[-1], dtype=self.features[0].dtype, device=self.device)
        within = torch.zeros(len(rows), n, n, dtype=torch.bool)
        for b, (row, row_sizes) in enumerate(zip(rows, sizes)):
            first = 0
            for (tokens, features, places), size in zip(row, row_sizes):
                ids[b, first:first + size] = torch.tensor(tokens)
                positions[b, first:first + size] = torch.tensor(places)
                feats[b, first:first + size] = features
                within[b, first:first + size, first:first + size] = torch.ones(size, size, dtype=torch.bool).tril()
                first += size
            within[b, first:, first:] = torch.eye(n - first, dtype=torch.bool)  # padding sees itself
        kv = self.kv[layer]
        mask = kv.append_mask(n, counts, self.dtype, self.device, within=within, positions=positions)
        hidden, logits = self.head.step(layer, ids.to(self.device), feats, positions.to(self.device),
                                        attention_mask=mask, past_key_values=kv.cache)
        return hidden, logits, counts

    def _advance(self) -> torch.Tensor:
        """Each layer k runs over every row's newly committed slots (token x_{s+k+1} known: s <= M-1-k); returns
        layer 0's logits at each row's last slot (the root's children)."""
        root_logits = None
        for layer in range(self.max_depth):
            slots = [range(f[layer], max(f[layer], len(t) - 1 - layer)) for f, t in zip(self.frontier, self.tokens)]
            if not any(slots):
                continue
            pieces = [[([t[s + layer + 1] for s in r], self._feature(b, layer, r), [s + layer for s in r])] if r else []
                      for b, (r, t) in enumerate(zip(slots, self.tokens))]
            hidden, logits, counts = self._run(layer, pieces)
            self.kv[layer].settle(counts)
            for b, r in enumerate(slots):
                if r:
                    done = self.real_hidden[b][layer]
                    new = hidden[b, :len(r)]
                    self.real_hidden[b][layer] = new if done is None else torch.cat([done, new])
                    self.frontier[b][layer] = r.stop
            if layer == 0:
                root_logits = _pick(logits, counts - 1)
        return self.draft._to_target(root_logits)

    def expand(self, requests: Requests) -> list[torch.Tensor | None]:
        depth = self.tree.add(requests)
        if depth >= self.max_depth:
            raise EyasError(f"the mtp draft has {self.max_depth} layers: shapes deeper than {self.max_depth} "
                            "cannot be drafted with it")
        pieces, made = [], []
        for b, request in enumerate(requests):
            last = len(self.tokens[b]) - 1  # M
            slots = range(max(0, last - depth), last)
            row, new = [], []
            for parent, token in zip(*request) if request else ():
                up = self.nodes[b][parent] if parent >= 0 else None
                path = (up["path"] if up else []) + [token]
                row.append(([path[s + depth - last] for s in slots], self._feature(b, depth, slots, up),
                            [s + depth for s in slots]))
                new.append({"path": path, "first_slot": slots.start})
            pieces.append(row)
            made.append(new)
        hidden, logits, _ = self._run(depth, pieces)
        self.kv[depth].keep([[] for _ in requests])  # the nodes' entries are never read again
        out = []
        for b, new in enumerate(made):
            size = len(pieces[b][0][0]) if new else 0  # every node of a row runs as many slots
            for j, node in enumerate(new):
                node["hidden"] = hidden[b, j * size:(j + 1) * size]
            self.nodes[b] += new
            out.append(self.draft._to_target(logits[b, size - 1:len(new) * size:size]) if new else None)
        return out

    def commit(self, kept: list[list[int]], accepted: list[list[int]], roots: list[int],
               features: list[torch.Tensor]) -> torch.Tensor:
        for b, (tokens, root, row) in enumerate(zip(accepted, roots, features)):
            self.tokens[b] += tokens + [root]
            self.features[b] = torch.cat([self.features[b], self.draft._project(row)])
            self.nodes[b] = []
        self.tree = TreeNodes(len(roots))
        return self._advance()

    def select(self, rows: torch.Tensor) -> None:
        for kv in self.kv:
            kv.select(rows)
        keep = rows.tolist()
        for name in ("tokens", "features", "frontier", "real_hidden", "nodes"):
            setattr(self, name, [getattr(self, name)[b] for b in keep])


def batch_unsupported(draft) -> str | None:
    """Why this draft x shape cannot run batched (None: it can)."""
    if isinstance(draft, MixtureDraft):
        return f"draft '{draft.name}': the mixture test draft runs one prompt at a time"
    return None


# The batched adapter of each drafting layout (eyas.draft.layouts), built from its one-at-a-time adapter.
BATCHED: dict[Layout, type] = {SHARED_LAYER: BatchedSharedLayerDraft, PARALLEL_SLOTS: BatchedParallelSlotsDraft,
                               LAYER_PER_STEP: BatchedPerStepDraft, BLOCK: BatchedBlockDraft}


def batched_draft(draft, depth: int):
    """The batched adapter of `draft` for trees `depth` deep: a head's per its layout, a token draft's own."""
    if isinstance(draft, HeadDraft):
        return BATCHED[draft.head.layout](draft, depth)
    return BatchedLMDraft(draft)


# --------------------------------------------------------------------------------------------
# How the rows draft: start / draw (one tree per row) / commit / select


class TogetherDrafts:
    """Every row's tree built in lockstep through a batched adapter: each depth's expansions of every row in one
    draft forward, each row's builder (`tree_steps`) drawing as one at a time with the row's generator."""

    def __init__(self, draft, shape: Shape, params: SamplingParams):
        self.adapter, self.shape, self.params = batched_draft(draft, shape.depth), shape, params

    def start(self, prompts: list[list[int]], roots: list[int], features) -> torch.Tensor:
        return self.adapter.start(prompts, roots, features)

    def draw(self, roots: list[int], logits: torch.Tensor, generators: list) -> list[Tree]:
        steps = [tree_steps(self.shape, r, logits[i], self.params, generators[i]) for i, r in enumerate(roots)]
        trees: list[Tree | None] = [None] * len(steps)
        answers: list[torch.Tensor | None] = [None] * len(steps)
        while True:
            requests: Requests = [None] * len(steps)
            for i, row in enumerate(steps):
                if trees[i] is None:
                    try:
                        requests[i] = row.send(answers[i])
                    except StopIteration as built:
                        trees[i] = built.value
            if all(r is None for r in requests):
                return [self._cut(b, tree) for b, tree in enumerate(trees)]
            answers = self.adapter.expand(requests)

    def _cut(self, row: int, tree: Tree) -> Tree:
        """A chain cut by the draft's confidence (`confident_chain`), when the shape asks for it."""
        if not self.shape.confidence:
            return tree
        return confident_chain(tree, self.adapter.chain_confidence(row, tree.tokens[1:]), self.shape.confidence)

    def commit(self, trees: list[Tree], paths: list[list[int]], roots: list[int], features) -> torch.Tensor:
        return self.adapter.commit([drafted_path(t, p) for t, p in zip(trees, paths)],
                                   [t.path_tokens(p) for t, p in zip(trees, paths)], roots, features)

    def select(self, rows: torch.Tensor) -> None:
        self.adapter.select(rows)


# --------------------------------------------------------------------------------------------
# The decoder


class BatchedDecoder:
    """`generate(prompts, max_new_tokens, seeds)` -> one `DecodeResult` per prompt."""

    def __init__(self, target, draft, shape: Shape, params: SamplingParams, eos_token_ids: list[int] | None = None):
        reason = batch_unsupported(draft)
        if reason:
            raise ValueError(reason)
        self.single = SpeculativeDecoder(target, draft, shape, params, eos_token_ids)  # the same checks
        check_attention(target)
        self.target, self.shape, self.params = target, shape, params
        self.drafts = TogetherDrafts(draft, shape, params)
        self.eos = set(eos_token_ids if eos_token_ids is not None else stop_token_ids(target))
        self.device = target.device
        self.feature_layers = draft.feature_layers
        self._cache_kw = cache_kwarg(target)

    def _target_forward(self, kv: RaggedCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                        keep: int = 0):
        out = self.target(input_ids=ids.to(self.device), position_ids=positions.to(self.device), attention_mask=mask,
                          use_cache=True, output_hidden_states=self.feature_layers is not None, logits_to_keep=keep,
                          **{self._cache_kw: kv.cache})
        features = None
        if self.feature_layers is not None:
            features = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        return out.logits, features

    def _choose(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        if self.params.greedy:
            return int(logits.argmax())
        return sample(process_logits(logits, self.params), generator)

    @torch.inference_mode()
    def generate(self, prompts: list, max_new_tokens: int, seeds: list[int] | None = None) -> list[DecodeResult]:
        rows = [torch.as_tensor(p, dtype=torch.long).flatten().tolist() for p in prompts]
        for row in rows:
            self.single.check_prompt(len(row), max_new_tokens)
        seeds = seeds if seeds is not None else [0] * len(rows)
        generators = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        with row_invariant_attention(self.device, self.target.dtype):
            return self._generate(rows, max_new_tokens, generators)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, generators: list) -> list[DecodeResult]:
        clock = _Clock(self.device)
        target_forward = clock.timed("target", self._target_forward)
        start, draw, commit = (clock.timed("draft", f) for f in (self.drafts.start, self.drafts.draw, self.drafts.commit))
        begin = clock.now()
        results = [DecodeResult(tokens=[]) for _ in prompts]
        kv = RaggedCache()
        ids, counts = _left_padded(prompts)
        mask = kv.prefill_mask(counts, self.target.dtype, self.device, self.target.config)
        logits, features = target_forward(kv, ids, kv.prefill_positions(counts), mask, keep=1)
        kv.after_prefill(counts)
        roots = [self._choose(logits[b, -1], generators[b]) for b in range(len(prompts))]
        for result, root in zip(results, roots):
            result.tokens.append(root)
        live = [b for b, r in enumerate(roots) if r not in self.eos and max_new_tokens > 1]
        if live:
            root_logits = start(prompts, roots, features)
            if len(live) < len(prompts):
                self._select(kv, live)
            roots = [roots[b] for b in live]
            root_logits = root_logits[live]
        while live:
            trees = draw(roots, root_logits, [generators[b] for b in live])
            paths, bonuses, features = self._verify(kv, trees, [generators[b] for b in live], target_forward)
            accepted = []
            for b, tree, path, bonus in zip(live, trees, paths, bonuses):
                _count(results[b], tree, path)
                accepted.append(tree.path_tokens(path))
                results[b].tokens += accepted[-1] + [bonus]
            going = [i for i, b in enumerate(live)
                     if len(results[b].tokens) < max_new_tokens and not self.eos.intersection(accepted[i] + [bonuses[i]])]
            if not going:
                break
            if len(going) < len(live):
                self._select(kv, going)
            live = [live[i] for i in going]
            roots = [bonuses[i] for i in going]
            row_features = [features[i][[0] + paths[i]] for i in going] if features is not None else None
            root_logits = commit([trees[i] for i in going], [paths[i] for i in going], roots, row_features)
        total = clock.now() - begin
        share = 1.0 / len(prompts)  # the batch's time, split evenly: per-row sums give the batch's wall time
        for result in results:
            result.tokens = _cut(result.tokens, self.eos, max_new_tokens)
            result.total_s = total * share
            result.draft_s, result.target_s = clock.seconds["draft"] * share, clock.seconds["target"] * share
        return results

    def _select(self, kv: RaggedCache, keep: list[int]) -> None:
        rows = torch.tensor(keep, dtype=torch.long)
        kv.select(rows)
        self.drafts.select(rows)

    def _verify(self, kv: RaggedCache, trees: list[Tree], generators: list, target_forward):
        """All rows' trees in one forward (right-padded to the largest; each node sees its row's entries, its
        ancestors and itself, at its root's position + its depth); each row keeps its root and accepted path."""
        sizes = [len(t) for t in trees]
        n = max(sizes)
        ids = torch.tensor([t.tokens + [t.tokens[-1]] * (n - len(t)) for t in trees], dtype=torch.long)
        within = torch.zeros(len(trees), n, n, dtype=torch.bool)
        depths = torch.zeros(len(trees), n, dtype=torch.long)
        for i, tree in enumerate(trees):
            within[i, :sizes[i], :sizes[i]] = tree.ancestor_mask()
            depths[i, :sizes[i]] = torch.tensor(tree.depths)
        positions = kv.append_positions(n, depths)
        mask = kv.append_mask(n, torch.tensor(sizes), self.target.dtype, self.device, self.target.config,
                              within=within, positions=positions)
        logits, features = target_forward(kv, ids, positions, mask)
        paths, bonuses = [], []
        greedy = logits.argmax(-1).tolist() if self.params.greedy else None
        for i, tree in enumerate(trees):
            if greedy is not None:
                path, bonus = verify_greedy(tree.children, tree.tokens, greedy[i])
            else:
                probs = process_logits(logits[i, :sizes[i]], self.params)
                path, bonus = verify_sampled(tree.children, tree.tokens, probs, tree.child_q, generators[i])
            paths.append(path)
            bonuses.append(bonus)
        kv.keep([[0] + p for p in paths])
        return paths, bonuses, (list(features) if features is not None else None)
