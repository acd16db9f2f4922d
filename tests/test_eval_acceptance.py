"""A draft with a known per-token acceptance rate gives the expected alpha and tau through the decoder."""

from __future__ import annotations

import torch
from test_eval_exact import VOCAB, tiny_vocab_target

from eyas.decode import SamplingParams
from eyas.eval.decoder import SpeculativeDecoder
from eyas.eval.drafts import MixtureDraft
from eyas.shapes import parse_shape

torch.set_num_threads(1)


def test_known_acceptance_draft_gives_expected_tau(tmp_path):
    """q = lam p + (1 - lam) delta(argmin p): alpha = lam + (1 - lam) p_min, tau = (1 - a^(K+1)) / (1 - a)."""
    target = tiny_vocab_target(tmp_path)
    lam, depth = 0.6, 3
    params = SamplingParams(1.0)
    draft = MixtureDraft(target, lam, params)
    decoder = SpeculativeDecoder(target, draft, parse_shape(f"chain:{depth}"), params, eos_token_ids=[], seed=5)
    accepted = []
    generator = torch.Generator().manual_seed(11)
    attempts = accepts = 0
    while len(accepted) < 1500:
        prompt = torch.randint(0, VOCAB, (6,), generator=generator)
        result = decoder.generate(prompt, 60)
        accepted += result.accepted
        attempts += sum(result.attempts)
        accepts += sum(result.accepts)
    alpha_lo = lam
    alpha_hi = max(draft.acceptance)  # lam + (1 - lam) * largest p_min seen
    assert alpha_hi - lam < 0.02      # the fixed distribution barely overlaps p: alpha is lam to 2 points

    def tau_of(a):
        return (1 - a ** (depth + 1)) / (1 - a)

    acc = torch.tensor(accepted, dtype=torch.float64)
    tau = 1 + float(acc.mean())
    error = 3 * float(acc.std()) / len(acc) ** 0.5
    print(f"tau={tau:.3f} expected {tau_of(alpha_lo):.3f}..{tau_of(alpha_hi):.3f} (+-{error:.3f}); "
          f"alpha={accepts / attempts:.3f} expected {lam}")
    assert tau_of(alpha_lo) - error <= tau <= tau_of(alpha_hi) + error
    rate = accepts / attempts
    rate_error = 3 * (lam * (1 - lam) / attempts) ** 0.5
    assert alpha_lo - rate_error <= rate <= alpha_hi + rate_error
    # and a measurably different lam would be told apart at this sample size
    assert abs(tau_of(lam + 0.1) - tau_of(lam)) > 2 * error
