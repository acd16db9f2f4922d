"""The speculative decoder: a draft proposes a token tree, the target verifies it in one forward.

One round (batch size 1):
  1. the draft builds a tree under the root (the last chosen token) — `tree.build_tree`;
  2. the target runs [root, tree nodes] once, with the tree attention mask and each node's
     position = root position + depth; its KV cache then holds the prefix + every tree node;
  3. `verify` walks the tree (greedy match at T=0, recursive rejection sampling at T>0) and
     returns the accepted path and the bonus token the target chose after it;
  4. the target's cache keeps the root and the accepted path (moved next to the prefix, the
     rejected branches sliced off; nothing is recomputed) and the draft commits the same path.
The output is the target's greedy decode at T=0 and is distributed as the target's sampling at
T>0 (see `verify` for why).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.decode import (
    SamplingParams,
    cache_kwarg,
    left_padded_ids,
    new_cache,
    plain_decode,
    process_logits,
    sample,
    seeded_generator,
    stop_token_ids,
    token_chooser,
)
from eyas.errors import EyasError
from eyas.eval.kv import check_attention, keep_positions, row_invariant_attention, tree_mask
from eyas.eval.tree import build_tree, confident_chain
from eyas.eval.verify import verify_greedy, verify_sampled
from eyas.shapes import Shape


@dataclass
class DecodeResult:
    """One prompt's decode: the tokens and what each verify round accepted."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)     # per verify: accepted draft tokens
    attempts: list[int] = field(default_factory=list)     # per depth d (index d-1): rounds that tried depth d
    accepts: list[int] = field(default_factory=list)      # per depth d: rounds that accepted depth d
    tree_sizes: list[int] = field(default_factory=list)   # draft tokens verified per round
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)


def max_context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


class _Clock:
    """Accumulates seconds per bucket; synchronises CUDA so kernel time lands where it belongs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = {"draft": 0.0, "target": 0.0}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def timed(self, bucket: str, fn):
        def run(*args, **kwargs):
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[bucket] += self.now() - start
        return run


class SpeculativeDecoder:
    """Target + draft + shape + sampling settings -> `generate(prompt_ids, max_new_tokens)`."""

    def __init__(self, target, draft, shape: Shape, params: SamplingParams,
                 eos_token_ids: list[int] | None = None, seed: int = 0):
        check_attention(target)
        if int(draft.vocab_size) != int(target.config.vocab_size):
            raise EyasError(f"draft '{draft.name}' returns {draft.vocab_size} logits but the target's vocabulary "
                            f"has {target.config.vocab_size} tokens: the draft was made for another target")
        # what the draft declares (`eyas.eval.drafts.Draft`), checked once here for every decoder, batched too
        if draft.max_depth is not None and shape.depth > draft.max_depth:
            raise EyasError(f"draft '{draft.name}' drafts at most {draft.max_depth} tokens deep (one mtp layer or block "
                            f"row per step); shape '{shape.spec}' needs {shape.depth}")
        if shape.confidence and not draft.gives_confidence:
            raise EyasError(f"shape '{shape.spec}' cuts the chain by the draft's confidence, which draft '{draft.name}' "
                            "does not give (a dspark draft does); use chain:K")
        self.target = target
        self.draft = draft
        self.shape = shape
        self.params = params
        self.eos = set(eos_token_ids if eos_token_ids is not None else stop_token_ids(target))
        self.device = target.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._cache_kw = cache_kwarg(target)
        self.feature_layers = draft.feature_layers

    # -- target --------------------------------------------------------------------------------

    def _target_forward(self, cache, ids: list[int], positions: list[int], mask, keep: int = 0):
        """(logits of the last `keep` positions (0: all) [n, V], the draft's features [len(ids), F] or None)."""
        out = self.target(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            attention_mask=mask, use_cache=True, output_hidden_states=self.feature_layers is not None,
            logits_to_keep=keep, **{self._cache_kw: cache},
        )
        features = None
        if self.feature_layers is not None:
            features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)
        return out.logits[0], features

    def _choose(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(logits.argmax())
        return sample(process_logits(logits, self.params), self.generator)

    # -- decoding ------------------------------------------------------------------------------

    def check_prompt(self, prompt_len: int, max_new_tokens: int) -> None:
        """EyasError when prompt + generation + one verify tree cannot fit the target's context."""
        need = prompt_len + max_new_tokens + self.shape.max_nodes + 1
        if need > max_context(self.target):
            raise EyasError(f"prompt of {prompt_len} tokens + {max_new_tokens} new + a {self.shape.max_nodes}-node "
                            f"tree exceeds the target's context of {max_context(self.target)} tokens")

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int) -> DecodeResult:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        self.check_prompt(len(prompt), max_new_tokens)
        with row_invariant_attention(self.device, self.target.dtype):  # as the reference (`target_decode`) runs
            return self._generate(prompt, max_new_tokens)

    def _generate(self, prompt: torch.Tensor, max_new_tokens: int) -> DecodeResult:
        clock = _Clock(self.device)
        target_forward = clock.timed("target", self._target_forward)
        start, expand, commit = (clock.timed("draft", f) for f in (self.draft.start, self.draft.expand, self.draft.commit))
        begin = clock.now()
        result = DecodeResult(tokens=[])

        cache = new_cache()
        prefix = len(prompt)
        # only the last prompt position's logits are read (the draft takes hidden states, not logits)
        logits, features = target_forward(cache, prompt.tolist(), list(range(prefix)), None, keep=1)
        root = self._choose(logits[-1])
        result.tokens.append(root)
        if root not in self.eos and max_new_tokens > 1:
            self.draft.plan_depth(self.shape.depth)  # one draft object may serve decoders of several depths
            root_logits = start(prompt.to(self.device), root, features)
            while True:
                kept, accepted, bonus, features = self._round(cache, prefix, root, root_logits, expand,
                                                              target_forward, result)
                result.tokens += accepted + [bonus]
                prefix += 1 + len(accepted)
                if len(result.tokens) >= max_new_tokens or self.eos.intersection(accepted + [bonus]):
                    break
                root_logits = commit(kept, accepted, bonus, features)
                root = bonus
        result.tokens = _cut(result.tokens, self.eos, max_new_tokens)
        result.total_s = clock.now() - begin
        result.draft_s, result.target_s = clock.seconds["draft"], clock.seconds["target"]
        return result

    def _round(self, cache, prefix: int, root: int, root_logits, expand, target_forward, result: DecodeResult):
        """Draft, verify, prune. Returns (kept draft ids, accepted tokens, bonus, features for the commit)."""
        tree = build_tree(self.shape, root, root_logits, expand, self.params, self.generator)
        if self.shape.confidence:
            tree = confident_chain(tree, self.draft.chain_confidence(tree.tokens[1:]), self.shape.confidence)
        positions = [prefix + d for d in tree.depths]
        mask = tree_mask(self.target.config, prefix, tree.ancestor_mask(), tree.depths, self.target.dtype,
                         self.device)
        logits, features = target_forward(cache, tree.tokens, positions, mask)
        if self.params.greedy:
            path, bonus = verify_greedy(tree.children, tree.tokens, logits.argmax(-1).tolist())
        else:
            probs = process_logits(logits, self.params)
            path, bonus = verify_sampled(tree.children, tree.tokens, probs, tree.child_q, self.generator)
        keep_positions(cache, prefix, [0] + path)  # root + accepted path; rejected branches dropped
        _count(result, tree, path)
        commit_features = features[[0] + path] if features is not None else None
        return drafted_path(tree, path), tree.path_tokens(path), bonus, commit_features


def drafted_path(tree, path: list[int]) -> list[int]:
    """The draft's ids of the accepted nodes it ran forward: a prefix of the path (a leaf it never expanded ends
    it), the entries its `commit` keeps."""
    kept = []
    for node in path:
        if tree.draft_ids[node] < 0:
            break
        kept.append(tree.draft_ids[node])
    return kept


def _count(result: DecodeResult, tree, path: list[int]) -> None:
    """Per-depth attempts/accepts: depth d is tried when the accepted node at d-1 has children."""
    result.accepted.append(len(path))
    result.tree_sizes.append(len(tree) - 1)
    on_path = [0] + path
    for depth in range(1, len(path) + 2):
        if depth - 1 >= len(on_path) or not tree.children[on_path[depth - 1]]:
            break
        while len(result.attempts) < depth:
            result.attempts.append(0)
            result.accepts.append(0)
        result.attempts[depth - 1] += 1
        if depth <= len(path):
            result.accepts[depth - 1] += 1


def _cut(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    """Stop after the first end-of-sequence token and at `limit` tokens, like HF generate."""
    for i, token in enumerate(tokens[:limit]):
        if token in eos:
            return tokens[: i + 1]
    return tokens[:limit]


def target_decode(target, prompt_ids, max_new_tokens: int, params: SamplingParams, eos_token_ids: list[int],
                  seed: int = 0) -> list[int]:
    """The target alone, timed as the eval baseline: a bare KV-cache loop (`eyas.decode.plain_decode`),
    the fastest way this target decodes one sequence here (HF `generate` is about 6% slower per
    token on 2 CPU cores), so a speedup is never flattered by a slow baseline."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()[None].to(target.device)
    choose = token_chooser(params, seeded_generator(target.device, seed))
    eos = torch.tensor(sorted(eos_token_ids) or [-1], device=target.device)
    with row_invariant_attention(target.device, target.dtype):  # as the speculative decoder runs it
        tokens = plain_decode(target, prompt, torch.ones_like(prompt), max_new_tokens, eos, choose)[0]
    return _cut(tokens, set(eos_token_ids), max_new_tokens)


def target_decode_batch(target, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
                        eos_token_ids: list[int], seed: int = 0) -> list[list[int]]:
    """`target_decode` over a left-padded batch (the baseline of a batched eval): one sampler for the
    batch, so at T > 0 a row's draws depend on its batch; at T = 0 each row is its prompt's greedy decode."""
    ids, mask = left_padded_ids([list(p) for p in prompts], target.device)
    choose = token_chooser(params, seeded_generator(target.device, seed))
    eos = torch.tensor(sorted(eos_token_ids) or [-1], device=target.device)
    with row_invariant_attention(target.device, target.dtype):
        rows = plain_decode(target, ids, mask, max_new_tokens, eos, choose)
    return [_cut(tokens, set(eos_token_ids), max_new_tokens) for tokens in rows]


@torch.inference_mode()
def target_generate(target, prompt_ids, max_new_tokens: int, params: SamplingParams,
                    eos_token_ids: list[int], seed: int = 0) -> list[int]:
    """The target alone through HF `generate` with its KV cache: the independent reference the tests
    hold the speculative decoder (and `target_decode`) to."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()[None].to(target.device)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_ids or None,
                  pad_token_id=(eos_token_ids or [0])[0], attention_mask=torch.ones_like(prompt))
    if params.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    out = target.generate(prompt, **kwargs)
    return _cut(out[0, prompt.shape[1]:].tolist(), set(eos_token_ids), max_new_tokens)
