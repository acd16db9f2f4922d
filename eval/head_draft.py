"""The adapter from a trained draft head (eagle, eagle3, peagle, mtp, dflash, dspark) to the decoder's draft protocol.

It replays at inference exactly what `eyas.train.ttt` trains (see that module's docstring):

eagle / eagle3 (one layer, KV layer 0). Slot t holds the pair (feature f_t, token x_{t+1}) at
RoPE position t. The committed slots are step-0 entries computed from the target's own
features. Drafting the children of the root x_M is step 0 at slot M-1 (the last committed
pair); a tree node at depth d is expanded by step d at slot M-1, position M-1+d, feature = the
hidden its parent's expansion produced, attending to the committed slots and to its own
ancestors' entries (the training-time-test mask: context + the diagonal of earlier steps).
On commit the tree entries are dropped (they were made from draft features) and the accepted
pairs are recomputed as step 0 from the target's features at the old root and the accepted
tokens, which also yields the new root's children.

mtp (layer k per step, KV layer k, token feed "data"). Layer k's entry at slot s reads token
x_{s+k+1} and the feature of slot s (layer k-1's hidden there, or the target's f_s with
`mtp_feed=target`), at position s+k. Layer k holds committed entries for the slots whose
token is committed (s <= M-1-k). A node at depth d runs layer d over slots M-d..M-1 with the
drafted tokens of its own path standing in for the unknown x_{M+1..M+d} (as SGLang's
multi-layer draft extend does); those rows attend to layer d's committed entries and causally
to each other, and are dropped on commit, when each layer advances over the slots whose
tokens became known.

peagle (`ParallelSlotsDraft`) and dflash and dspark (`BlockDraft`) are described at their classes; `ADAPTERS`
names the adapter of each drafting layout (`eyas.draft.layouts`).

Logits are mapped to the target vocabulary through d2t (-inf for tokens outside the draft
vocabulary).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from eyas.draft.checkpoint import load_draft, read_draft_config
from eyas.draft.head import DraftHead
from eyas.draft.layouts import BLOCK, LAYER_PER_STEP, PARALLEL_SLOTS, SHARED_LAYER, Layout
from eyas.errors import EyasError
from eyas.eval.drafts import Draft
from eyas.targets import target_identity


class HeadDraft(Draft):
    """A trained head driven through the draft protocol (`eyas.eval.drafts.Draft`); the shared part.

    `head_draft(head, name)` picks the adapter of the head's drafting layout (`ADAPTERS`). What the decoder asks
    of a draft (`feature_layers`, `max_depth`, `gives_confidence`, `plan_depth`) each adapter answers from what
    its head declares.
    """

    def __init__(self, head: DraftHead, name: str):
        self.head = head
        self.kind = head.kind
        self.name = name
        cfg = head.config
        self.vocab_size = int(cfg.vocab_size)
        # the target hidden states the decoder hands over: the fused layers, or the last one (post-norm)
        # the fused layers it reads, or the last hidden state (-1) for a head that reads no target layer
        self.feature_layers = head.feature_spec.target_layers(cfg.aux_layers, cfg.target_hidden_layers) or [-1]
        self.max_depth = head.max_depth()
        device = next(head.parameters()).device
        self.device = device
        self.target_ids = None
        if head.d2t is not None:
            self.target_ids = head.draft_to_target(torch.arange(head.draft_vocab_size, device=device))
        self.cache = None

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.target_ids is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, self.target_ids] = logits
        return out

    def _step(self, k: int, tokens: list[int], features: torch.Tensor, positions: list[int], mask=None):
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([positions], device=self.device)
        hidden, logits = self.head.step(k, ids, features[None], pos, attention_mask=mask, past_key_values=self.cache)
        return hidden[0], logits[0]

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        dtype = next(self.head.parameters()).dtype
        return self.head.project(features.to(self.device, dtype))

    def _crop(self, layer: int, length: int) -> None:
        if layer < len(self.cache.layers):
            entry = self.cache.layers[layer]
            if getattr(entry, "keys", None) is not None and entry.keys.numel():
                entry.keys = entry.keys[..., :length, :]
                entry.values = entry.values[..., :length, :]

    def _begin(self, prompt_ids: torch.Tensor, root: int, features: torch.Tensor) -> None:
        self.cache = DynamicCache()
        self.tokens = prompt_ids.tolist() + [root]  # x_0 .. x_M (M = root position)
        self.features = self._project(features)     # f_0 .. f_{M-1}
        self.nodes: list[dict] = []


def mask_slot_inputs(head: DraftHead, hidden: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (..., n), features (..., n, H)) of `n` mask slots after the hidden state `hidden` (..., H).
    The slots read the mask token and feature whatever token and hidden they are given."""
    lead = hidden.shape[:-1]
    ids = torch.zeros(*lead, n, dtype=torch.long, device=hidden.device)
    return head.mask_slots(ids, hidden.unsqueeze(-2).expand(*lead, n, -1))


class SharedLayerDraft(HeadDraft):
    """eagle / eagle3: one layer (KV layer 0) for every draft step (see the module docstring)."""

    def start(self, prompt_ids: torch.Tensor, root: int, features: torch.Tensor) -> torch.Tensor:
        self._begin(prompt_ids, root, features)
        self.committed = 0
        self.slot_logits: list[torch.Tensor] = []  # a parallel drafter's logits per depth, this round
        return self._extend(self.tokens[1:], self.features)

    def expand(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        first = len(self.nodes)
        for offset, parent in enumerate(parents):
            up = self.nodes[parent] if parent >= 0 else None
            self.nodes.append({"bits": (1 << (first + offset)) | (up["bits"] if up else 0),
                               "depth": up["depth"] + 1 if up else 1})
        new = self.nodes[first:]
        feats = torch.stack([self.nodes[p]["hidden"] if p >= 0 else self.root_hidden for p in parents])
        total = len(self.nodes)
        rows = torch.tensor([[(n["bits"] >> i) & 1 for i in range(total)] for n in new], dtype=torch.bool)
        visible = torch.cat([torch.ones(len(new), self.committed, dtype=torch.bool), rows], dim=1)
        positions = [self.committed - 1 + n["depth"] for n in new]
        hidden, logits = self._step(new[0]["depth"], tokens, feats, positions, visible[None, None].to(self.device))
        for node, h in zip(new, hidden):
            node["hidden"] = h
        return self._to_target(logits)

    def commit(self, kept: list[int], tokens: list[int], root: int, features: torch.Tensor) -> torch.Tensor:
        new_features = self._project(features)
        self.nodes = []
        self.slot_logits = []
        self._crop(0, self.committed)
        self.tokens += tokens + [root]
        return self._extend(tokens + [root], new_features)

    def _extend(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Step 0 over new committed pairs (f_t, x_{t+1}); returns the last pair's logits."""
        positions = list(range(self.committed, self.committed + len(tokens)))
        hidden, logits = self._step(0, tokens, features, positions)
        self.committed += len(tokens)
        self.root_hidden = hidden[-1]
        return self._to_target(logits[-1:])[0]


class ParallelSlotsDraft(SharedLayerDraft):
    """peagle: the shared layer, every node of depth d >= 1 reading the mask slot's token and feature.

    A node sees the committed slots and its ancestors, which are mask slots too: every depth-d node
    has the same logits, known before any token is drafted. So the slots for depths 1..D run in one
    forward, D from `plan_depth` (the decoder's tree depth - 1), as vLLM runs them; deeper nodes
    extend the run.
    """

    planned = 0  # mask slots to run in one forward (`plan_depth`); 0: as deep as the node asked for

    def plan_depth(self, depth: int) -> None:
        """The decoder drafts trees `depth` deep until told otherwise (their nodes to expand: depths 1..depth-1)."""
        self.planned = depth - 1

    def expand(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """Parallel drafting: the logits of the depth-d mask slot for each of these depth-d nodes (see the class)."""
        depth = self.nodes[parents[0]]["depth"] + 1 if parents[0] >= 0 else 1
        if any((self.nodes[p]["depth"] + 1 if p >= 0 else 1) != depth for p in parents):
            raise EyasError("a parallel drafter expands one depth at a time; the decoder mixed depths")
        self.nodes += [{"depth": depth} for _ in parents]
        done = len(self.slot_logits)
        if depth > done:  # slots done+1..upto, each at position committed-1+d, causal over the ones above it
            upto, cached = max(depth, self.planned), self.committed + done
            n = upto - done
            ids, feats = mask_slot_inputs(self.head, self.root_hidden, n)
            visible = torch.cat([torch.ones(n, cached, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
            positions = list(range(self.committed + done, self.committed + upto))
            # step k only selects the layer of a per-step kind: one shared layer runs every slot
            _, logits = self._step(1, ids.tolist(), feats, positions, visible[None, None].to(self.device))
            self.slot_logits += list(self._to_target(logits))
        return self.slot_logits[depth - 1][None].expand(len(parents), -1)


class PerStepDraft(HeadDraft):
    """mtp: layer k (KV layer k) for draft step k (see the module docstring)."""

    def start(self, prompt_ids: torch.Tensor, root: int, features: torch.Tensor) -> torch.Tensor:
        self._begin(prompt_ids, root, features)
        self.frontier = [0] * self.max_depth    # committed slots per layer
        self.real_hidden: list[torch.Tensor | None] = [None] * self.max_depth
        return self._advance()

    def commit(self, kept: list[int], tokens: list[int], root: int, features: torch.Tensor) -> torch.Tensor:
        new_features = self._project(features)
        self.nodes = []
        self.tokens += tokens + [root]
        self.features = torch.cat([self.features, new_features])
        for layer in range(self.max_depth):
            self._crop(layer, self.frontier[layer])
        return self._advance()

    def _feature(self, layer: int, slots: range, parent_rows: dict | None = None) -> torch.Tensor:
        """Features of `layer` at `slots`: the target's f_s at layer 0, then as the head feeds its layers
        (`next_feature`) from layer-1's hidden (committed, or the parent's rows) and f_s."""
        target = self.features[slots.start:slots.stop]
        if layer == 0:
            return target
        rows = []
        for s in slots:
            if s < self.frontier[layer - 1]:
                rows.append(self.real_hidden[layer - 1][s])
            else:
                rows.append(parent_rows["hidden"][s - parent_rows["first_slot"]])
        return self.head.next_feature(torch.stack(rows), target)

    def _advance(self) -> torch.Tensor:
        """Each layer k runs over its newly committed slots (token x_{s+k+1} known: s <= M-1-k)."""
        last = len(self.tokens) - 1  # M
        logits0 = None
        for layer in range(self.max_depth):
            slots = range(self.frontier[layer], max(self.frontier[layer], last - layer))
            if len(slots):
                feats = self._feature(layer, slots)
                tokens = [self.tokens[s + layer + 1] for s in slots]
                hidden, logits = self._step(layer, tokens, feats, [s + layer for s in slots])
                done = self.real_hidden[layer]
                self.real_hidden[layer] = hidden if done is None else torch.cat([done, hidden])
                self.frontier[layer] = slots.stop
                if layer == 0:
                    logits0 = logits[-1:]
        return self._to_target(logits0)[0]

    def expand(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        last = len(self.tokens) - 1
        outs = []
        for parent, token in zip(parents, tokens):
            up = self.nodes[parent] if parent >= 0 else None
            depth = up["depth"] + 1 if up else 1
            if depth >= self.max_depth:
                raise EyasError(f"the mtp draft has {self.max_depth} layers: shapes deeper than {self.max_depth} "
                                "cannot be drafted with it")
            path = (up["path"] if up else []) + [token]
            slots = range(max(0, last - depth), last)
            feats = self._feature(depth, slots, up)
            step_tokens = [path[s + depth - last] for s in slots]  # x_{s+d+1} = depth (s+d+1-M) on the path
            before = self.cache.get_seq_length(depth) if depth < len(self.cache.layers) else 0
            n = len(slots)
            visible = torch.cat([torch.ones(n, self.frontier[depth], dtype=torch.bool),
                                 torch.zeros(n, before - self.frontier[depth], dtype=torch.bool),
                                 torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
            hidden, logits = self._step(depth, step_tokens, feats, [s + depth for s in slots],
                                        visible[None, None].to(self.device))
            self.nodes.append({"depth": depth, "path": path, "hidden": hidden, "first_slot": slots.start})
            outs.append(logits[-1])
        return self._to_target(torch.stack(outs))


class BlockDraft(HeadDraft):
    """dflash, dspark: one forward per round drafts the whole block (`eyas.draft.block_layout.BlockHead.block_rows`).

    The context is the target's features f_0..f_{M-1} of the committed tokens (each layer's keys and
    values kept and extended on commit); the block is the root x_M at position M and its mask rows after it,
    and predicting row d (0-based) gives the logits of every node at depth d+1, as the head turns the row and
    the node's parent's token into logits (`slot_logits`): DFlash ignores the token, so siblings share a
    distribution and chains are its natural shape; DSpark's Markov head conditions each child on its own
    parent, which a tree serves as it is. A head that declares `gives_confidence` (dspark) also gives the
    probability that each draft of a chain is accepted (`chain_confidence`), by which a chain may be cut."""

    def __init__(self, head: DraftHead, name: str):
        super().__init__(head, name)
        self.gives_confidence = head.gives_confidence

    def start(self, prompt_ids: torch.Tensor, root: int, features: torch.Tensor) -> torch.Tensor:
        self._begin(prompt_ids, root, features)
        self.context = self.head.context(self.features[None], torch.arange(len(self.features), device=self.device))
        return self._block(root)

    def expand(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        depths = []
        for parent in parents:
            depth = self.nodes[parent]["depth"] + 1 if parent >= 0 else 1
            if depth >= self.max_depth:
                raise EyasError(f"the {self.kind} draft drafts {self.max_depth} tokens per block: shapes deeper than "
                                f"{self.max_depth} cannot be drafted with it")
            self.nodes.append({"depth": depth})
            depths.append(depth)
        return self._to_target(self._slot_logits(depths, tokens))

    def commit(self, kept: list[int], tokens: list[int], root: int, features: torch.Tensor) -> torch.Tensor:
        new_features = self._project(features)
        start = len(self.tokens) - 1  # the old root's position: its feature is the first new one
        self.nodes = []
        self.tokens += tokens + [root]
        positions = torch.arange(start, start + len(new_features), device=self.device)
        added = self.head.context(new_features[None], positions)
        self.context = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                        for (k, v), (nk, nv) in zip(self.context, added)]
        return self._block(root)

    def chain_confidence(self, tokens: list[int]) -> list[float]:
        """The draft's probability that each of this round's chain drafts `tokens` is accepted (`slot_confidence`
        of row k read with the token before draft k: the root, then the chain's own)."""
        return chain_confidence(self.head, self.rows, self.tokens[-1], tokens)

    def _slot_logits(self, depths: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [n, V_draft] of the children of n nodes: row depth_i read with the node's own token."""
        return self.head.slot_logits(self.rows[depths], torch.tensor(tokens, device=self.device))

    def _block(self, root: int) -> torch.Tensor:
        """Draft the block after root x_M: keeps its predicting rows, returns the root's children's logits."""
        position = len(self.tokens) - 1
        visible = torch.ones(1, position, dtype=torch.bool, device=self.device)
        anchor = torch.tensor([[root]], device=self.device)
        self.rows = self.head.block_rows(anchor, torch.tensor([position], device=self.device), self.context, visible,
                                         self.max_depth)[0, 0]  # [K, H]
        return self._to_target(self._slot_logits([0], [root]))[0]


def chain_confidence(head: DraftHead, rows: torch.Tensor, root: int, tokens: list[int]) -> list[float]:
    """Per chain draft k, sigmoid of the head's confidence of block row k read with the token before it (a head that
    declares `gives_confidence`: the decoder refuses a chain cut by confidence with any other)."""
    before = torch.tensor([root] + tokens[:-1], device=rows.device)
    return torch.sigmoid(head.slot_confidence(rows[:len(tokens)], before).float()).tolist()


# The eval adapter of each drafting layout (eyas.draft.layouts).
ADAPTERS: dict[Layout, type[HeadDraft]] = {SHARED_LAYER: SharedLayerDraft, PARALLEL_SLOTS: ParallelSlotsDraft,
                                           LAYER_PER_STEP: PerStepDraft, BLOCK: BlockDraft}


def head_draft(head: DraftHead, name: str) -> HeadDraft:
    """The adapter of a head's drafting layout."""
    return ADAPTERS[head.layout](head, name)


def check_head_against_target(config: dict, meta: dict, target, tokenizer, target_path: str | None, where: Path) -> None:
    """Refuse a head made for another target, saying which property differs."""
    tcfg = target.config
    problems = []
    if int(config["hidden_size"]) != int(tcfg.hidden_size):
        problems.append(f"hidden size {config['hidden_size']} vs the target's {tcfg.hidden_size}")
    if int(config["vocab_size"]) != int(tcfg.vocab_size):
        problems.append(f"vocabulary {config['vocab_size']} vs the target's {tcfg.vocab_size}")
    layers = int(tcfg.num_hidden_layers)
    bad_layers = [i for i in config.get("aux_layers") or [] if not -layers - 1 <= int(i) <= layers]
    if bad_layers:
        problems.append(f"fused layers {bad_layers} do not exist in a {layers}-layer target")
    saved_identity = meta.get("target_identity") or config.get("target_identity") or ""
    if not problems and saved_identity and target_path is not None and tokenizer is not None:
        identity = target_identity(target.config, tokenizer)
        if identity != saved_identity:
            problems.append(f"target identity {saved_identity} vs this target's {identity} "
                            "(another model, tokenizer or chat template)")
    if problems:
        raise EyasError(f"draft '{where}' was made for another target: " + "; ".join(problems))


def load_head_draft(directory: Path, target, tokenizer, device=None, target_path: str | None = None) -> HeadDraft:
    """Load a trained head from a draft directory (`eyas.draft.checkpoint.load_draft`) for this target."""
    directory = Path(directory)
    config = read_draft_config(directory)
    check_head_against_target(config, config.get("meta", {}), target, tokenizer, target_path, directory)
    head, meta = load_draft(directory, device=device or target.device, dtype=target.dtype)
    if head.d2t is not None and int(head.d2t.numel()) != int(head.draft_vocab_size):
        raise EyasError(f"draft '{directory}': its d2t map does not match its draft vocabulary")
    # `<run>/checkpoints/step_N` is labelled by its run (several runs' drafts compared in one table)
    owner = directory.parent.parent.name if directory.parent.name == "checkpoints" else config["kind"]
    return head_draft(head.eval().requires_grad_(False), f"{owner}:{directory.name}")
