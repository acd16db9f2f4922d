"""The precision `eyas eval` runs its target in, decided by measuring this machine (`eval.target_dtype`).

A bf16 target is faster on machines with native bf16 (a GPU, a CPU with AMX), but a verify over
several tokens and a decode of one token sum in other orders, and bf16 rounds a near-tie into another
token now and then: the speculative output then leaves the target's own greedy decode although no
draft token was wrong. So `auto` (with no `target.dtype` set) measures, once per machine and target,
cached under `<eyas cache>/precision/`:

- `exact`: the target's 1-token greedy decode of a few fixed prompts (chat-templated), then the same
  tokens verified in chunks of 2-8 over the KV cache (the decoder's verify: a tree mask for a chain,
  `row_invariant_attention`). D is the largest difference between a verify's logits and the 1-token
  step's at the same position. Exact when no verify chose another token AND no position's top two
  step logits lie within 2D of each other: such a near-tie is within the rounding's reach, and a tree
  verify (other masked positions, other widths) can flip it even where no probed chunk did. Counting
  flips alone is not enough: on SmolLM2 in bf16 (AVX512-BF16) 0 of 240 chunked positions flipped
  while the quickstart's tree decodes left the greedy output on 4 and 3 of 8 prompts;
- `tokens_per_s`: the target alone, the same 1-token KV-cache loop as the eval's baseline.

`auto` picks bf16 where it is exact (at T > 0 exactness is not asked: the verify samples) and the
target alone is at least BF16_MARGIN faster in it (a tie within the timing noise keeps fp32),
else fp32. fp32 is measured the same way and recorded, but not required to pass: its rounding
differences are a few ulps of fp32, have flipped no token in any run here, and the decoder's tests
hold it to the greedy decode. On a CPU without native bf16 (no AMX, no AVX512-BF16) bf16 is emulated
and slower; nothing is measured there.

Whatever the eval's precision, its speedup is against the fastest target alone measured
(`baseline_dtype`): where bf16 is faster but not exact, the eval runs in fp32 and its target-alone
baseline in bf16, and the table names the baseline's precision.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

from eyas.decode import cache_kwarg, new_cache, plain_decode, stop_token_ids
from eyas.eval.kv import row_invariant_attention, tree_mask
from eyas.eval.prompts import Prompt, render
from eyas.io import atomic_write_json
from eyas.precision import cpu_flags, native_bf16, warn_slow_bf16
from eyas.targets import (
    cache_dir,
    load_target,
    load_target_config,
    load_tokenizer,
    pick_device,
    resolve_target_path,
    target_identity,
)

EVAL_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # eval.target_dtype's forced values
PROBE_VERSION = 3  # 3: chat-templated prompts; near-ties within reach of the rounding count as inexact
PROBE_TEXTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "What are three good questions to ask at the end of a job interview?",
    "Translate 'the weather is lovely today, let us walk to the harbour' into French and German.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List the planets of the solar system with one fact about each.",
)
PROBE_NEW_TOKENS = 48
CHUNKS = (2, 3, 5, 8)  # verify widths, cycled: a chain of K=1, 2, 4, 7 drafts
BF16_MARGIN = 1.05     # bf16's target-alone speed over fp32's that picks it: two runs of one loop vary a few %


@dataclass(frozen=True)
class EvalPrecision:
    """The eval's target precision and the precision its target-alone baseline is timed in."""

    dtype: str           # `target.dtype` value the speculative decodes and the =greedy reference run in
    baseline_dtype: str  # the fastest measured; the speedup's denominator runs in it
    reason: str          # one line for the report and the quickstart
    probe: dict | None   # the measurement (None when nothing was measured)


def choose(target: Any, setting: str, temperature: float) -> EvalPrecision:
    """The eval's precision for `eval.target_dtype = setting` with the recipe's `target` settings."""
    device = pick_device(target.device)
    if setting != "auto":  # forced; bf16 on a CPU without native bf16 is obeyed with one warning line
        if setting == "bf16":
            warn_slow_bf16("eval.target_dtype", setting, device)
        dtype = EVAL_DTYPES[setting]
        return EvalPrecision(dtype, dtype, f"{dtype}: set by eval.target_dtype={setting}", None)
    if target.dtype != "auto":
        return EvalPrecision(target.dtype, target.dtype, f"{target.dtype}: set by target.dtype", None)
    if not native_bf16(device):
        return EvalPrecision("float32", "float32", "float32: bf16 is not native here (no AMX, no AVX512-BF16), "
                             "so it is emulated and slower", None)
    probe = measured(target, device)
    fp32, bf16 = probe["float32"], probe["bfloat16"]
    faster = bf16["tokens_per_s"] >= BF16_MARGIN * fp32["tokens_per_s"]
    baseline = "bfloat16" if bf16["tokens_per_s"] > fp32["tokens_per_s"] else "float32"
    speeds = f"target alone {bf16['tokens_per_s']:.1f} tokens/s in bf16, {fp32['tokens_per_s']:.1f} in fp32"
    exact = (f"bf16 verifies {'exact' if bf16['exact'] else 'not exact'}: of {bf16['positions']} positions "
             f"{bf16['mismatches']} flipped and {bf16['near_ties']} are near-ties within 2x its largest "
             f"rounding difference {bf16['max_logit_diff']:.3g}")
    if faster and (bf16["exact"] or temperature > 0):
        how = "and exact" if bf16["exact"] else "(T > 0 samples: exactness not asked)"
        return EvalPrecision("bfloat16", baseline, f"bfloat16: measured faster {how} here ({speeds}; {exact})", probe)
    why = f"not {BF16_MARGIN:g}x faster" if not faster else "not exact at T=0"
    return EvalPrecision("float32", baseline, f"float32: bf16 measured {why} here ({speeds}; {exact})", probe)


def measured(target: Any, device: Any) -> dict:
    """The probe's figures for fp32 and bf16 on this machine and target, from the cache or measured now."""
    folder = resolve_target_path(target.path)
    config = load_target_config(target.path, trust_remote_code=bool(getattr(target, "trust_remote_code", False)))
    identity = target_identity(config, load_tokenizer(target), folder)
    key = _machine_key(device, identity)
    path = cache_dir() / "precision" / f"{key}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass  # a damaged cache file is measured again and rewritten
    print("eyas eval: eval.target_dtype=auto: measuring this machine's fp32 and bf16 target once "
          f"({len(PROBE_TEXTS)} prompts x {PROBE_NEW_TOKENS} tokens each; cached in {path})", flush=True)
    probe = {dtype: probe_dtype(*load_target(dataclasses.replace(target, dtype=dtype), device))
             for dtype in ("float32", "bfloat16")}
    probe.update(target_identity=identity, machine=_machine(device), version=PROBE_VERSION)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, probe)
    return probe


def _machine(device: Any) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "platform": platform.platform()}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["bf16_flags"] = sorted(f for f in (cpu_flags() or set()) if "bf16" in f or f.startswith("amx"))
    return info


def _machine_key(device: Any, identity: str) -> str:
    import transformers

    flags = sorted(cpu_flags() or set())
    what = [PROBE_VERSION, identity, _machine(device), flags, transformers.__version__, torch.get_num_threads()]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


@torch.inference_mode()
def probe_dtype(target: Any, tokenizer: Any) -> dict:
    """Target-alone speed and verify exactness of one loaded target (see the module docstring)."""
    eos = set(stop_token_ids(target, tokenizer))
    prompts = [probe_prompt(tokenizer, text) for text in PROBE_TEXTS]
    decode_steps(target, prompts[0], 4, eos)  # warm-up: kernel selection, allocation
    tokens, seconds, gaps, diffs, flips = 0, 0.0, [], [], 0
    for prompt in prompts:
        start = time.perf_counter()
        decoded, steps = decode_steps(target, prompt, PROBE_NEW_TOKENS, eos)
        seconds += time.perf_counter() - start
        tokens += len(decoded)
        verified = verify_logits(target, prompt, decoded)  # row i predicts decoded[i + 1], as steps[i + 1] did
        stepped = steps[1:len(verified) + 1]
        top2 = stepped.topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        diffs += (verified - stepped).abs().amax(-1).tolist()
        flips += int((verified.argmax(-1) != stepped.argmax(-1)).sum())
    largest = max(diffs, default=0.0)
    # a position whose top two step logits lie within twice the largest rounding difference measured
    # could flip in some verify: a near-tie within reach, counted even where no probed verify flipped it
    near_ties = sum(gap <= 2 * largest for gap in gaps)
    return {"tokens_per_s": tokens / max(seconds, 1e-9), "positions": len(gaps), "mismatches": flips,
            "near_ties": near_ties, "max_logit_diff": largest, "exact": flips == 0 and near_ties == 0,
            "dtype": str(target.dtype).replace("torch.", "")}


def decode_steps(target: Any, prompt: list[int], new_tokens: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """The target's 1-token greedy decode (`plain_decode`, the eval baseline's KV-cache loop): the tokens and
    each step's logits [tokens, V] in fp32 (row 0 from the prompt's last position)."""
    logits: list[torch.Tensor] = []

    def greedy(step: torch.Tensor) -> torch.Tensor:  # [1, V] fp32 -> [1]; kept for the comparison
        logits.append(step[0])
        return step.argmax(-1)

    ids = torch.tensor([prompt], device=target.device)
    with row_invariant_attention(target.device, target.dtype):
        tokens = plain_decode(target, ids, torch.ones_like(ids), new_tokens,
                              torch.tensor(sorted(eos) or [-1], device=target.device), greedy)[0]
    return tokens, torch.stack(logits)


def probe_prompt(tokenizer: Any, text: str) -> list[int]:
    """`text` as a one-turn eval prompt (`render`: the target's chat template, plain where it has none)."""
    return render(Prompt(id="probe", category="probe", messages=[{"role": "user", "content": text}]), tokenizer)


@torch.inference_mode()
def verify_logits(target: Any, prompt: list[int], decoded: list[int]) -> torch.Tensor:
    """A chain verify of `decoded` after `prompt`, as the decoder runs it when every draft is right: the
    prompt prefilled, then `decoded` in chunks of CHUNKS widths over the KV cache with the tree mask.
    Row i (fp32) is the verify's logits at decoded[i], which choose decoded[i + 1]; len(decoded) - 1 rows."""
    cache, cache_kw, device = new_cache(), cache_kwarg(target), target.device
    rows = []
    with row_invariant_attention(device, target.dtype):
        target(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        prefix, at, width = len(prompt), 0, 0
        while at < len(decoded) - 1:
            n = min(CHUNKS[width % len(CHUNKS)], len(decoded) - 1 - at)
            mask = tree_mask(target.config, prefix, torch.ones(n, n, dtype=torch.bool).tril(), list(range(n)),
                             target.dtype, device)
            rows.append(target(input_ids=torch.tensor([decoded[at:at + n]], device=device),
                               position_ids=torch.arange(prefix, prefix + n, device=device)[None],
                               attention_mask=mask, use_cache=True, **{cache_kw: cache}).logits[0].float())
            prefix, at, width = prefix + n, at + n, width + 1
    return torch.cat(rows) if rows else torch.zeros(0, target.config.vocab_size, device=device)
