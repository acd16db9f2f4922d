"""Eval stage: tree speculative decoder with exact verification, acceptance reports.

Modules:
  tree        draft shapes (chain:K, static trees, EAGLE-2 dynamic) and building the token tree
  verify      sampling settings, candidate drawing, greedy and rejection-sampling verification
  kv          4D tree masks for HF models and in-place KV-cache pruning
  decoder     SpeculativeDecoder (target + draft + shape), target_decode (the timed baseline),
              target_generate (HF generate, the reference in tests)
  drafts      the draft protocol, LMDraft / truncated_target, MixtureDraft, make_draft
  head_draft  the adapter from trained heads of every kind, one per drafting layout
  prompts     MT-bench / OpenAI / held-out prompts, rendered with the chat template
  metrics     alpha, cumulative acceptance, tau, speedup, time split
  runner      several drafts x shapes over the same prompts, interleaved with the target alone
  report      rich table, JSON, PNG plot
  cli         `eyas eval`
  memory      eval's memory model, which `eyas plan` composes with the dump's and the trainer's
"""
