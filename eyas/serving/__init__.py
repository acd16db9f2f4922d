"""Serving-engine plugins shipped with eyas (loaded by the engine, never imported by eyas itself).

- `eyas.serving.vllm_mtp`: vLLM (`vllm.general_plugins` entry point `eyas_mtp`) serves eyas's
  per-step `mtp` drafts for dense Llama/Qwen-family targets. See docs/serving-mtp.md.
"""
