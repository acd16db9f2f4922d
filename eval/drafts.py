"""Drafts the decoder can drive, and the protocol they share (`Draft`, the base class of every draft).

The draft protocol (what a draft declares is on `Draft`, with the defaults of a token-only draft, so the
decoder asks a draft and never probes it):

    name: str                      label in tables and plots
    vocab_size: int                size of the logits it returns (the target's vocabulary)
    feature_layers: list | None    HF `hidden_states` indices of the target features it reads
                                   (concatenated in that order), or None for a token-only draft
    max_depth: int | None          the deepest tree it drafts (an mtp head's layers, a block head's
                                   predicting rows), or None for any
    gives_confidence: bool         `chain_confidence` gives the probability that each draft of a chain
                                   is accepted (a dspark head), so a chain may be cut by it
    start(prompt_ids, root, features) -> logits [V]
        New prompt. prompt_ids: LongTensor [L]; root: the first token the target chose after it;
        features: target features at the L prompt positions [L, F] (or None). Returns the draft's
        logits for the root's children (depth 1).
    expand(parents, tokens) -> logits [n, V]
        Add n tree nodes: parents are draft node ids (-1 = the root), tokens their tokens.
        New nodes get the next ids (0, 1, 2, ... counted from the last start/commit). Returns the
        logits for each new node's children.
    commit(kept, tokens, root, features) -> logits [V]
        After a verify: `tokens` are the accepted draft tokens in order, `root` the token the target
        chose after them (the next root), `kept` the draft ids of the accepted nodes the draft ran
        (a prefix of the path), `features` the target features at the old root and at each
        accepted token [len(tokens) + 1, F] (or None). Drops the rest of the tree; returns the
        logits for the new root's children.
    plan_depth(depth)
        The decoder drafts trees `depth` deep from the next `start` on. A parallel drafter (peagle)
        runs the draft steps of all those depths in one forward (`eyas.eval.head_draft`); nothing
        for the others.
    chain_confidence(tokens) -> list[float]
        Only where `gives_confidence`: per draft of this round's chain `tokens`, the draft's
        probability that it is accepted.

Logits are raw (the decoder applies temperature/top-k/top-p to them exactly as to the
target's), over the target's vocabulary (-inf for tokens a reduced-vocabulary draft cannot emit).

Drafts here:
- `LMDraft`: any HF causal LM that reads tokens (e.g. `truncated_target`, the target's first
  n layers with its norm and lm_head): tree nodes run with a tree mask in its own KV cache and
  the accepted ones are kept on commit.
- `MixtureDraft`: q = lam * p + (1 - lam) * point mass on p's least likely token, p the target's
  own sampling distribution (it runs the target as an oracle). Per-token acceptance is
  lam + (1 - lam) * p_min, known in advance: the check for the acceptance bookkeeping.
- `HeadDraft` (a trained head of any kind: eagle, eagle3, mtp, peagle, dflash, dspark): see
  `eyas.eval.head_draft.load_head_draft`.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from eyas.decode import SamplingParams, cache_kwarg, new_cache, process_logits
from eyas.errors import EyasError
from eyas.eval.kv import additive_mask, keep_positions


class Draft(ABC):
    """What the speculative decoder needs of a draft (see the module docstring); every draft is one."""

    name: str
    vocab_size: int
    feature_layers: list[int] | None = None
    max_depth: int | None = None
    gives_confidence: bool = False

    @abstractmethod
    def start(self, prompt_ids: torch.Tensor, root: int, features: torch.Tensor | None) -> torch.Tensor: ...

    @abstractmethod
    def expand(self, parents: list[int], tokens: list[int]) -> torch.Tensor: ...

    @abstractmethod
    def commit(self, kept: list[int], tokens: list[int], root: int, features: torch.Tensor | None
               ) -> torch.Tensor: ...

    def plan_depth(self, depth: int) -> None:
        """The decoder drafts trees `depth` deep from the next `start` on: a draft that runs several depths in one
        forward plans them here; the others have nothing to plan."""
        return None

    # chain_confidence(tokens): only on a draft that declares `gives_confidence` (the decoder refuses a
    # confidence-cut shape for any other before it decodes).


class LMDraft(Draft):
    """A token-only draft: an HF causal LM sharing the target's tokenizer (no target features, any depth)."""

    def __init__(self, model, name: str):
        self.model = model
        self.name = name
        self.vocab_size = int(model.config.vocab_size)
        self._cache_kw = cache_kwarg(model)
        self.cache = None
        self.committed = 0          # cache entries that belong to the committed sequence
        self.node_bits: list[int] = []   # per tree node: bitset of itself + its tree ancestors
        self.node_depth: list[int] = []

    def _forward(self, ids: list[int], positions: list[int], mask: torch.Tensor | None) -> torch.Tensor:
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            attention_mask=mask, use_cache=True, **{self._cache_kw: self.cache},
        )
        return out.logits[0].float()

    def start(self, prompt_ids: torch.Tensor, root: int, features=None) -> torch.Tensor:
        self.cache = new_cache()
        ids = prompt_ids.tolist() + [root]
        logits = self._forward(ids, list(range(len(ids))), None)
        self.committed = len(ids)
        self._clear_tree()
        return logits[-1]

    def _clear_tree(self) -> None:
        self.node_bits, self.node_depth = [], []

    def expand(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        first = len(self.node_bits)
        for offset, parent in enumerate(parents):
            own = 1 << (first + offset)
            self.node_bits.append(own | (self.node_bits[parent] if parent >= 0 else 0))
            self.node_depth.append(self.node_depth[parent] + 1 if parent >= 0 else 1)
        total = len(self.node_bits)
        rows = [[(self.node_bits[first + j] >> i) & 1 for i in range(total)] for j in range(len(parents))]
        visible = torch.cat([torch.ones(len(parents), self.committed, dtype=torch.bool),
                             torch.tensor(rows, dtype=torch.bool)], dim=1)
        mask = additive_mask(visible, self.model.dtype, self.model.device)
        root_position = self.committed - 1
        positions = [root_position + self.node_depth[first + j] for j in range(len(parents))]
        return self._forward(tokens, positions, mask)

    def commit(self, kept: list[int], tokens: list[int], root: int, features=None) -> torch.Tensor:
        # the draft's KV for accepted nodes it ran is valid (it read real tokens): keep it
        keep_positions(self.cache, self.committed, kept)
        self.committed += len(kept)
        rest = tokens[len(kept):] + [root]
        positions = list(range(self.committed, self.committed + len(rest)))
        logits = self._forward(rest, positions, None)
        self.committed += len(rest)
        self._clear_tree()
        return logits[-1]


def truncated_target(target, num_layers: int):
    """The target's first `num_layers` decoder layers + its final norm and lm_head, sharing weights.

    A real language model that drafts from tokens alone: the baseline draft before a head is
    trained, and a draft whose greedy tokens often agree with the target.
    """
    from transformers import AutoModelForCausalLM

    depth = int(target.config.num_hidden_layers)
    if not 1 <= num_layers <= depth:
        raise EyasError(f"truncated draft: num_layers must be in 1..{depth} for this target, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    body, source = draft.model, target.model
    body.embed_tokens = source.embed_tokens
    body.layers = torch.nn.ModuleList(list(source.layers)[:num_layers])
    body.norm = source.norm
    body.rotary_emb = source.rotary_emb
    draft.lm_head = target.lm_head
    leftover = [n for n, p in draft.named_parameters() if p.is_meta] + [n for n, b in draft.named_buffers() if b.is_meta]
    if leftover:
        raise EyasError(f"truncated draft: cannot share the target's weights for {leftover[:3]} "
                        f"({type(target).__name__} has an unexpected layout)")
    draft.config._attn_implementation = target.config._attn_implementation
    return draft.eval().requires_grad_(False)


class MixtureDraft(LMDraft):
    """q = lam * p + (1 - lam) * delta(argmin p): a draft whose acceptance rate is known.

    Runs the target itself as an oracle for p (the target's sampling distribution under
    `params`, which must be T > 0 without top-k/top-p so that the decoder's processing of the
    returned logits T * log q gives back q exactly). Expected acceptance of every drafted token:
    sum_x min(p, q) = lam + (1 - lam) * p_min; `acceptance` records it for each proposal.
    """

    def __init__(self, target, lam: float, params: SamplingParams):
        if params.greedy or params.top_k or params.top_p < 1:
            raise EyasError("the mixture draft needs temperature > 0 with top_k=0 and top_p=1")
        if not 0 <= lam <= 1:
            raise EyasError(f"mixture draft: lam must be in [0, 1], got {lam}")
        super().__init__(target, f"mixture:{lam:g}")
        self.lam = lam
        self.params = params
        self.acceptance: list[float] = []

    def _forward(self, ids, positions, mask):
        p = process_logits(super()._forward(ids, positions, mask), self.params)
        p_min, z = p.min(dim=-1)
        q = self.lam * p
        q[torch.arange(len(ids)), z] += 1.0 - self.lam
        self._row_acceptance = (self.lam + (1.0 - self.lam) * p_min).tolist()
        return self.params.temperature * q.log()

    # only the rows whose logits propose tokens count: the last one after start/commit, all after expand
    def start(self, prompt_ids, root, features=None):
        logits = super().start(prompt_ids, root, features)
        self.acceptance.append(self._row_acceptance[-1])
        return logits

    def expand(self, parents, tokens):
        logits = super().expand(parents, tokens)
        self.acceptance += self._row_acceptance
        return logits

    def commit(self, kept, tokens, root, features=None):
        logits = super().commit(kept, tokens, root, features)
        self.acceptance.append(self._row_acceptance[-1])
        return logits


def describe_draft_spec() -> str:
    return "a draft checkpoint directory, truncated:N (the target's first N layers) or mixture:LAM"


def make_draft(spec: str, target, target_tokenizer, params: SamplingParams, device=None,
               target_path: str | None = None):
    """Build a draft from a spec string: `truncated:N`, `mixture:LAM` or a checkpoint directory.

    `target_path` (the target's path or alias) lets a checkpoint's recorded target identity be checked.
    """
    spec = str(spec).strip()
    if spec.startswith("truncated:"):
        text = spec.partition(":")[2]
        try:
            n = int(text)
        except ValueError:
            raise EyasError(f"draft {spec!r}: N must be an integer number of layers") from None
        return LMDraft(truncated_target(target, n), f"truncated:{n}")
    if spec.startswith("mixture:"):
        try:
            lam = float(spec.partition(":")[2])
        except ValueError:
            raise EyasError(f"draft {spec!r}: LAM must be a number in [0, 1]") from None
        if math.isnan(lam):
            raise EyasError(f"draft {spec!r}: LAM must be a number in [0, 1]")
        return MixtureDraft(target, lam, params)
    path = Path(spec).expanduser()
    if path.is_dir():
        from eyas.eval.head_draft import load_head_draft  # its drafts are `Draft`s: it imports this module

        return load_head_draft(path, target, target_tokenizer, device, target_path)
    raise EyasError(f"draft {spec!r} is neither an existing directory nor a known draft; give {describe_draft_spec()}")
