"""Acceptance metrics, defined once: users confuse alpha with cumulative acceptance (docs/design.md).

Per verify round the decoder records n = the number of draft tokens accepted, and for each
depth d whether depth d was *tried* (the accepted node at depth d-1 had children in the tree)
and accepted.

  alpha_d       = P(token d accepted | tokens 1..d-1 accepted)  = accepts_d / attempts_d
  cumulative_d  = P(at least d tokens accepted in a round)      = #(n >= d) / rounds
  tau           = mean tokens produced per target verify, counting the bonus token = 1 + mean(n)
                  (plain decoding = 1.00)
  tau_from_alpha = 1 + sum_d prod_{j<=d} alpha_j                 (tau predicted from the alphas; equals
                  tau when every round can try every depth, as in a chain)
  tau_iid       = (1 - a^(K+1)) / (1 - a), a = all accepts / all attempts: the i.i.d. chain formula
                  (chains only), to compare with the measured tau
  speedup       = tokens/s of the speculative decoder / tokens/s of the target alone (a bare KV-cache
                  loop, `decoder.target_decode`), same prompts, same run, prefill included on both sides
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tally:
    """Sums over decodes (one configuration, optionally one category)."""

    prompts: int = 0
    rounds: int = 0
    tokens: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)   # rounds with n accepted, n = index
    attempts: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    tree_nodes: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    matched: int = 0          # T=0: prompts whose output equals the target's greedy output
    compared: int = 0

    def add(self, result, reference: list[int] | None = None) -> None:
        self.prompts += 1
        self.rounds += result.rounds
        self.tokens += len(result.tokens)
        self.accepted += sum(result.accepted)
        for n in result.accepted:
            _grow(self.histogram, n + 1)
            self.histogram[n] += 1
        _grow(self.attempts, len(result.attempts))
        _grow(self.accepts, len(result.accepts))
        for d, (a, b) in enumerate(zip(result.attempts, result.accepts)):
            self.attempts[d] += a
            self.accepts[d] += b
        self.tree_nodes += sum(result.tree_sizes)
        self.draft_s += result.draft_s
        self.target_s += result.target_s
        self.total_s += result.total_s
        if reference is not None:
            self.compared += 1
            self.matched += int(result.tokens == reference)


def _grow(values: list, size: int) -> None:
    while len(values) < size:
        values.append(0)


@dataclass
class BaselineTally:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.prompts += 1
        self.tokens += tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def summarize(tally: Tally, depth: int, chain: bool = False, baseline: BaselineTally | None = None) -> dict:
    """The report numbers for one tally (`depth`: the shape's depth, the length of the per-depth lists)."""
    rounds = max(tally.rounds, 1)
    attempts = (tally.attempts + [0] * depth)[:depth]
    accepts = (tally.accepts + [0] * depth)[:depth]
    alpha = [accepts[d] / attempts[d] if attempts[d] else None for d in range(depth)]
    at_least = [sum(tally.histogram[d:]) for d in range(1, depth + 1)]
    cumulative = [c / rounds if tally.rounds else None for c in at_least]
    tau = 1.0 + tally.accepted / rounds if tally.rounds else None
    tau_from_alpha, running = 1.0, 1.0
    for a in alpha:
        running *= a or 0.0
        tau_from_alpha += running
    total_attempts = sum(attempts)
    alpha_mean = sum(accepts) / total_attempts if total_attempts else None
    tau_iid = None
    if chain and alpha_mean is not None:
        tau_iid = float(depth + 1) if alpha_mean == 1 else (1 - alpha_mean ** (depth + 1)) / (1 - alpha_mean)
    bookkeeping = max(tally.total_s - tally.draft_s - tally.target_s, 0.0)
    tokens_per_s = tally.tokens / tally.total_s if tally.total_s > 0 else None
    base = baseline.tokens_per_s if baseline is not None else None
    summary = {
        "prompts": tally.prompts,
        "rounds": tally.rounds,
        "tokens": tally.tokens,
        "alpha": alpha,
        "cumulative": cumulative,
        "attempts": attempts,
        "accepts": accepts,
        "alpha_mean": alpha_mean,
        "tau": tau,
        "tau_from_alpha": tau_from_alpha if tally.rounds else None,
        "tau_iid": tau_iid,
        "accepted_histogram": list(tally.histogram),
        "mean_tree_nodes": tally.tree_nodes / rounds if tally.rounds else None,
        "tokens_per_s": tokens_per_s,
        "baseline_tokens_per_s": base,
        "speedup": tokens_per_s / base if tokens_per_s and base else None,
        "time": {
            "total_s": tally.total_s, "draft_s": tally.draft_s, "target_s": tally.target_s,
            "bookkeeping_s": bookkeeping,
            "draft_frac": tally.draft_s / tally.total_s if tally.total_s > 0 else None,
            "target_frac": tally.target_s / tally.total_s if tally.total_s > 0 else None,
            "bookkeeping_frac": bookkeeping / tally.total_s if tally.total_s > 0 else None,
        },
    }
    if tally.compared:
        summary["greedy_match"] = {"matched": tally.matched, "compared": tally.compared}
    return summary
