"""Candidate drawing and exact tree verification (the sampling rules live in `eyas.decode`).

Why these rules keep the output exact:

* Temperature, top-k and top-p are applied by one function (`process_logits`) to the target's
  logits (p) and to the draft's logits (q), so the distribution the decoder reproduces is the
  target's own sampling distribution with the same settings.
* Greedy (T = 0): walk down the tree while some child carries the target's argmax token; the
  argmax at the last accepted node is the bonus token. The output is the target's greedy decode.
* Sampled (T > 0), ``q`` mode (chains and static trees): the children of a node are drawn from
  q *without replacement* (Gumbel top-m). The j-th child is then distributed as q_j = q with the
  earlier children removed and renormalised. Each child is tried in order with Leviathan's
  rule: accept x with probability min(1, p_j(x) / q_j(x)); on rejection
  p_{j+1} = norm((p_j - q_j)+). When all children are rejected the token is drawn from the last
  residual. Each step is a Leviathan step whose output is distributed as p_j whatever the later
  proposals are, so by induction the token leaving a node is distributed as p. A chain is the
  case of one child per node (plain Leviathan et al.).
* Sampled, ``delta`` mode (EAGLE-2 dynamic trees): the children are chosen deterministically
  (top-k of q, then reranked globally), so the proposal for the j-th child is a point mass;
  the same rule with q_j = delta(x_j) accepts x_j with probability p_j(x_j) and sets
  p_{j+1} = p_j with x_j removed, renormalised. Exact for any candidate set chosen without
  looking at the target's random draws.
"""

from __future__ import annotations

import torch

from eyas.decode import SamplingParams, process_logits, sample


def draw_candidates(logits: torch.Tensor, count: int, params: SamplingParams,
                    generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
    """Up to `count` distinct child tokens of one node, best/first first.

    Greedy: the top-`count` draft tokens. Sampled: `count` draws from q without replacement
    (Gumbel top-m); returns the tokens and q (the probabilities they were drawn from).
    """
    if params.greedy:
        return logits.topk(count).indices.tolist(), None
    q = process_logits(logits, params)
    support = int((q > 0).sum().item())
    count = min(count, support)
    if count == 1:
        return [sample(q, generator)], q
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float32).clamp_(min=1e-20)
    keys = q.log() - torch.log(-torch.log(u))  # Gumbel-perturbed log q; top-m = sampling w/o replacement
    return keys.topk(count).indices.tolist(), q


def _renormalised(x: torch.Tensor) -> torch.Tensor | None:
    total = x.sum()
    if not total > 0:
        return None
    return x / total


def rejection_step(p: torch.Tensor, q: torch.Tensor | None, token: int, uniform: float
                   ) -> tuple[bool, torch.Tensor, torch.Tensor | None]:
    """One sibling of recursive rejection sampling.

    p: the current target distribution at the parent; q: the distribution this candidate was
    drawn from (None: a deterministic candidate, q = point mass). Returns (accepted, p for the
    next sibling, q for the next sibling).
    """
    if q is None:  # delta proposal
        if uniform < float(p[token]):
            return True, p, None
        residual = p.clone()
        residual[token] = 0.0
        nxt = _renormalised(residual)
        return False, (nxt if nxt is not None else p), None
    qx = float(q[token])
    ratio = float(p[token]) / qx if qx > 0 else 0.0
    if uniform < ratio:  # min(1, p/q): ratio >= 1 always passes since uniform < 1
        return True, p, q
    residual = _renormalised((p - q).clamp_(min=0.0))
    q_next = q.clone()
    q_next[token] = 0.0
    return False, (residual if residual is not None else p), _renormalised(q_next)


def verify_greedy(children: list[list[int]], tokens: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Greedy walk: returns (accepted node indices along the path, bonus token).

    Indices are verify positions (0 = root); `children[i]` lists node i's children,
    `target_argmax[i]` is the target's greedy token after node i.
    """
    path: list[int] = []
    node = 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def verify_sampled(children: list[list[int]], tokens: list[int], target_probs: torch.Tensor,
                   child_q: dict[int, torch.Tensor | None], generator: torch.Generator | None
                   ) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree: (accepted path, bonus/correction token).

    target_probs: [n+1, V] processed target distributions at each verify position;
    child_q[i]: the q node i's children were drawn from (q mode), or None (delta mode).
    Children are tried in the order they were drawn.
    """
    path: list[int] = []
    node = 0
    while True:
        p = target_probs[node]
        q = child_q.get(node)
        accepted = None
        kids = children[node]
        if kids:
            uniforms = torch.rand(len(kids), generator=generator, device=p.device).tolist()
            for child, u in zip(kids, uniforms):
                ok, p, q = rejection_step(p, q, tokens[child], u)
                if ok:
                    accepted = child
                    break
        if accepted is None:
            return path, sample(p, generator)
        path.append(accepted)
        node = accepted
