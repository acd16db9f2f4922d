"""Eval stage: tree speculative decoder with exact verification, acceptance reports."""
