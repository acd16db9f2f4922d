"""Target-written prompts (`data.self_prompts: N`): the target writes the user turns itself.

An instruction-tuned model that is handed its chat template up to an open user turn
("<|im_start|>user\\n") writes the kind of request it was tuned on (the method of Magpie,
Xu et al. 2024). With the replies regenerated as well, these conversations come from the
target's own prompt distribution (questions, writing, code, advice) and need no dataset, so
they widen a chitchat-only training set towards the prompts a deployed draft meets.

Prompts are sampled (temperature and top-p from the recipe), deduplicated, and dropped when
they are empty or do not end within `data.regenerate_max_new_tokens`; every drop is counted in
`skipped.json`. Sampling stops when N prompts are kept or after 3N attempts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eyas.errors import EyasError

MARK = "\x00EYAS_PROMPT\x00"
ATTEMPTS_PER_PROMPT = 3  # give up after this many samples per wanted prompt (a model that rarely ends its turn)


def user_header(tokenizer: Any) -> str:
    """The chat template's text before a first user message's content (system prompt included)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    except Exception as exc:  # templates raise their own error types
        raise EyasError(f"data.self_prompts: the target's chat template cannot render a user turn ({exc})") from None
    if MARK not in text:
        raise EyasError("data.self_prompts: the target's chat template drops the user message's text; "
                        "set target.chat_template to a template that renders it")
    return text[: text.index(MARK)]


def keep_prompts(samples: list[str | None], wanted: int, seen: set[str], skips: Any, first_id: int,
                 seed: int) -> list[dict]:
    """Rows for the usable samples (None: the turn did not end), up to `wanted`; the rest counted in skips."""
    rows = []
    for offset, sampled in enumerate(samples):
        row_id = f"self-{seed}-{first_id + offset}"
        text = sampled.strip() if sampled is not None else None
        if text is None:
            skips.add("self prompt did not end within data.regenerate_max_new_tokens", row_id)
        elif not text:
            skips.add("self prompt empty", row_id)
        elif text in seen:
            skips.add("self prompt duplicate", row_id, text)
        elif len(rows) < wanted:
            seen.add(text)
            rows.append({"id": row_id, "messages": [{"role": "user", "content": text}]})
    return rows


def write_prompts(sample: Callable[[int], list[str | None]], count: int, batch_size: int, skips: Any, seed: int,
                  progress: Any = None) -> list[dict]:
    """`count` distinct user turns from `sample(n) -> n texts (None: unfinished)`, in batches."""
    rows: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < count and attempts < ATTEMPTS_PER_PROMPT * count:
        n = min(batch_size, ATTEMPTS_PER_PROMPT * count - attempts)
        new = keep_prompts(sample(n), count - len(rows), seen, skips, attempts, seed)
        rows += new
        attempts += n
        if progress is not None:
            progress.update(len(new))
    return rows


def hf_prompt_sampler(model: Any, tokenizer: Any, max_new_tokens: int, temperature: float, top_p: float,
                      seed: int) -> Callable[[int], list[str | None]]:
    """`sample(n)`: n user turns the target writes after its template's user header."""
    import torch

    from eyas.data.regenerate import stop_token_ids
    from eyas.eval.kv import plain_decode
    from eyas.eval.verify import SamplingParams, process_logits

    device = next(model.parameters()).device
    header = tokenizer(user_header(tokenizer), add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    stops = stop_token_ids(model, tokenizer)  # the end-of-turn token is among them for chat models
    stop_ids = torch.tensor(sorted(stops), device=device)
    params = SamplingParams(temperature, top_p)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)

    def choose(logits: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(process_logits(logits, params), 1, generator=generator).squeeze(1)

    def sample(n: int) -> list[str | None]:
        ids = header.expand(n, -1)
        new = plain_decode(model, ids, torch.ones_like(ids), max_new_tokens, stop_ids, choose)
        return [tokenizer.decode(seq[:-1], skip_special_tokens=True) if seq and seq[-1] in stops else None
                for seq in new]

    return sample


def self_prompt_rows(recipe: Any, model: Any, tokenizer: Any, skips: Any) -> list[dict]:
    """The prepare step: `data.self_prompts` conversations of one target-written user turn."""
    from tqdm import tqdm

    data = recipe.data
    sample = hf_prompt_sampler(model, tokenizer, data.regenerate_max_new_tokens, data.self_prompt_temperature,
                               data.self_prompt_top_p, recipe.run.seed)
    with tqdm(total=data.self_prompts, unit="prompt", desc="writing prompts", dynamic_ncols=True) as progress:
        rows = write_prompts(sample, data.self_prompts, data.regenerate_batch_size, skips, recipe.run.seed, progress)
    print(f"eyas prepare: the target wrote {len(rows)} of {data.self_prompts} prompts "
          f"({sum(n for r, n in skips.counts.items() if r.startswith('self prompt'))} samples dropped)", flush=True)
    return rows
