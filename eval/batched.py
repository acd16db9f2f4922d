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

How the rows draft:
- `TogetherDrafts`: token drafts (`LMDraft`, e.g. truncated:N), the shared-layer heads (eagle, eagle3,
  peagle) and dflash build every row's tree in lockstep: each row's builder (`eyas.eval.tree.tree_steps`)
  asks for its nodes of one depth, and every row's nodes of that depth run in ONE draft forward, each
  seeing its row's committed entries, its ancestors and itself (`TreeNodes`); peagle's mask slots and
  dflash's block run once per round for every row, so a round's draft forwards do not grow with the
  batch (docs/results.md, "Many prompts at once").
- `RowDrafts`: mtp heads (per-layer caches with their own frontiers): each row drafts with its own copy
  of the one-at-a-time draft, row after row, so only the verify is batched.
The mixture test draft runs one prompt at a time (`batch_unsupported`).
"""

from __future__ import annotations

import copy

import torch

from eyas.decode import SamplingParams, cache_kwarg, new_cache, process_logits, sample, stop_token_ids
from eyas.errors import EyasError
from eyas.eval.decoder import DecodeResult, SpeculativeDecoder, _Clock, _count, _cut, drafted_path
from eyas.eval.drafts import LMDraft, MixtureDraft
from eyas.eval.head_draft import BlockDraft, SharedLayerDraft, mask_slot_inputs
from eyas.eval.kv import check_attention, layer_masks, row_invariant_attention
from eyas.eval.tree import Expansion, Shape, Tree, build_tree, tree_steps
from eyas.eval.verify import verify_greedy, verify_sampled

# --------------------------------------------------------------------------------------------
# The ragged cache


class RaggedCache:
    """A batch KV cache whose row b holds columns [start_b, start_b + len_b) (see the module docstring)."""

    def __init__(self) -> None:
        self.cache = new_cache()
        self.start = torch.zeros(0, dtype=torch.long)
        self.lengths = torch.zeros(0, dtype=torch.long)

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
        if any(getattr(layer, "keys", None) is not None and layer.keys.numel() for layer in self.cache.layers):
            self.cache.batch_select_indices(rows.to(self.cache.layers[0].keys.device))
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


class BatchedSharedLayerDraft:
    """eagle / eagle3 / peagle (`SharedLayerDraft`) over a `RaggedCache`: slot t holds (f_t, x_{t+1}) at position
    t; a tree node at depth d is step d with its parent's hidden, attending to the committed slots, its ancestors
    and itself. A parallel drafter's mask slots for depths 1..depth-1 run in one forward at depth 1."""

    def __init__(self, draft: SharedLayerDraft, depth: int):
        self.draft = draft
        self.slots = depth - 1  # a tree `depth` deep expands its nodes at depths 1..depth-1
        self.head = draft.head
        self.name = draft.name
        self.vocab_size = draft.vocab_size
        self.feature_layers = draft.feature_layers
        self.max_depth = draft.max_depth
        self.dtype = next(self.head.parameters()).dtype
        self.device = draft.device

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
        if self.head.parallel_drafting:
            return self._mask_slots(requests, depth)
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

    def _mask_slots(self, requests: Requests, depth: int) -> list[torch.Tensor | None]:
        """Every depth-d node of a row has its row's depth-d mask slot logits; at depth 1 every depth's slots run
        in one forward (`SharedLayerDraft`)."""
        if self.slot_logits is None:
            n = max(self.slots, 1)
            rows = len(requests)
            ids, feature = mask_slot_inputs(self.head, self.root_hidden, n)
            counts = torch.full((rows,), n, dtype=torch.long)
            _, logits = self._step(1, ids, feature, self.kv.append_positions(n),
                                   self.kv.append_mask(n, counts, self.dtype, self.device))
            self.kv.settle(counts)
            self.slot_logits = logits
        slot = self.draft._to_target(self.slot_logits[:, depth - 1])
        return [slot[b, None].expand(len(r[0]), -1) if r else None for b, r in enumerate(requests)]

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


class BatchedBlockDraft:
    """dflash (`BlockDraft`) over a batch. Each row keeps its own context keys and values per layer (the
    target's features of its committed tokens, at their positions). A round's blocks, one per row, run in
    ONE forward as the blocks of one sequence whose context is every row's, each block seeing only its own
    row's columns (`DFlashHead.block_logits` takes a visibility row per block); slot d of row b's block gives
    the logits of row b's depth-d nodes, as `BlockDraft` gives them one row at a time."""

    def __init__(self, draft: BlockDraft):
        self.draft = draft
        self.head = draft.head
        self.name = draft.name
        self.vocab_size = draft.vocab_size
        self.feature_layers = draft.feature_layers
        self.max_depth = draft.max_depth
        self.device = draft.device

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
            raise EyasError(f"the dflash draft has {self.max_depth} mask slots: shapes deeper than "
                            f"{self.max_depth} cannot be drafted with it")
        slot = self.draft._to_target(self.slots[:, depth])
        return [slot[b, None].expand(len(r[0]), -1) if r else None for b, r in enumerate(requests)]

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
        """Every row's block after its root in one forward; keeps the slots' logits, returns slot 1's per row."""
        context = [tuple(torch.cat([row[layer][i] for row in self.contexts], dim=2) for i in (0, 1))
                   for layer in range(len(self.contexts[0]))]
        lengths = torch.tensor([row[0][0].shape[2] for row in self.contexts])
        ends = lengths.cumsum(0)
        columns = torch.arange(int(ends[-1]))
        visible = (columns[None, :] >= (ends - lengths)[:, None]) & (columns[None, :] < ends[:, None])
        logits = self.head.block_logits(torch.tensor([roots], device=self.device),
                                        torch.tensor(self.positions, device=self.device), context,
                                        visible.to(self.device), self.max_depth)
        self.slots, self.nodes = logits[0], TreeNodes(len(roots))  # [B, slots, V]
        return self.draft._to_target(self.slots[:, 0])

    def select(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.contexts = [self.contexts[b] for b in keep]
        self.positions = [self.positions[b] for b in keep]
        self.slots = self.slots[rows.to(self.slots.device)]


def batch_unsupported(draft) -> str | None:
    """Why this draft x shape cannot run batched (None: it can)."""
    if isinstance(draft, MixtureDraft):
        return f"draft '{draft.name}': the mixture test draft runs one prompt at a time"
    return None


def drafts_together(draft) -> bool:
    """True when the rows draft in lockstep, each depth's nodes of every row in one draft forward (a batched adapter
    exists); else each row drafts with its own copy of the one-at-a-time draft (`RowDrafts`)."""
    return isinstance(draft, (LMDraft, SharedLayerDraft, BlockDraft))


def batched_draft(draft, depth: int):
    """The batched adapter of `draft` for trees `depth` deep."""
    if isinstance(draft, SharedLayerDraft):
        return BatchedSharedLayerDraft(draft, depth)
    return BatchedBlockDraft(draft) if isinstance(draft, BlockDraft) else BatchedLMDraft(draft)


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
                return trees
            answers = self.adapter.expand(requests)

    def commit(self, trees: list[Tree], paths: list[list[int]], roots: list[int], features) -> torch.Tensor:
        return self.adapter.commit([drafted_path(t, p) for t, p in zip(trees, paths)],
                                   [t.path_tokens(p) for t, p in zip(trees, paths)], roots, features)

    def select(self, rows: torch.Tensor) -> None:
        self.adapter.select(rows)


class RowDrafts:
    """Each row drafts its own tree with its own copy of the one-at-a-time draft (mtp heads, whose layers keep
    caches with frontiers of their own): the drafts run row after row, exactly as one at a time, and the rows'
    trees are verified together in one forward. A copy shares the draft's weights; `start` gives it a state of
    its own."""

    def __init__(self, draft, shape: Shape, params: SamplingParams, device):
        self.draft, self.shape, self.params, self.device = draft, shape, params, device

    def start(self, prompts: list[list[int]], roots: list[int], features) -> torch.Tensor:
        """features: the target's left-padded prefill features [B, W, F] or None."""
        self.rows, logits = [], []
        for b, (prompt, root) in enumerate(zip(prompts, roots)):
            row = copy.copy(self.draft)
            if hasattr(row, "plan_depth"):
                row.plan_depth(self.shape.depth)
            own = features[b, features.shape[1] - len(prompt):] if features is not None else None
            logits.append(row.start(torch.tensor(prompt, device=self.device), root, own))
            self.rows.append(row)
        return torch.stack(logits)

    def draw(self, roots: list[int], logits: torch.Tensor, generators: list) -> list[Tree]:
        return [build_tree(self.shape, root, logits[i], row.expand, self.params, generators[i])
                for i, (row, root) in enumerate(zip(self.rows, roots))]

    def commit(self, trees: list[Tree], paths: list[list[int]], roots: list[int], features) -> torch.Tensor:
        return torch.stack([row.commit(drafted_path(tree, path), tree.path_tokens(path), root,
                                       features[i] if features is not None else None)
                            for i, (row, tree, path, root) in enumerate(zip(self.rows, trees, paths, roots))])

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[b] for b in rows.tolist()]


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
        self.drafts = (TogetherDrafts(draft, shape, params) if drafts_together(draft)
                       else RowDrafts(draft, shape, params, target.device))
        self.eos = set(eos_token_ids if eos_token_ids is not None else stop_token_ids(target))
        self.device = target.device
        self.feature_layers = getattr(draft, "feature_layers", None)
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
