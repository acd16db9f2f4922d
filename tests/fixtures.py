"""Tiny targets for tests: Llama-, Qwen2-, Qwen3-MoE-, gpt-oss- and Mistral-shaped models with a real tokenizer.

Everything is built in code (no network) and saved/loaded through the real
`save_pretrained` / `from_pretrained` path, so the stages see the same files a user's
model directory holds. The tokenizer is a byte-level BPE trained on a small built-in
corpus, with ChatML special tokens and the ChatML chat template that SmolLM2 and Qwen use.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# gpt-oss's harmony format (tests/data/templates/harmony.jinja): its special tokens, the last one ending generation.
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
TEMPLATES = Path(__file__).parent / "data" / "templates"

_CORPUS = [
    "Hello, how are you doing today? I am fine, thank you for asking.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a story about a hawk that learns to fly over the mountains.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "Can you summarise this text in two sentences? Sure, here is a short summary.",
    "I like music, movies, books and long walks in the park on sunny days.",
]


def build_tokenizer(vocab_size: int = 384, chat_format: str = "chatml"):
    """A byte-level BPE tokenizer with ChatML tokens and template (PreTrainedTokenizerFast); with
    `chat_format="harmony"`, gpt-oss's harmony tokens and template as well, `<|return|>` its end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    if chat_format == "harmony":
        fast.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS, "eos_token": "<|return|>"})
        fast.chat_template = (TEMPLATES / "harmony.jinja").read_text()
    return fast


def _tiny_config(family: str, vocab_size: int, **overrides):
    """A tiny config of the target family: Llama; Qwen2 (attention biases, its norm eps); Qwen3-MoE (a sparse
    MLP of 4 experts, 2 routed per token, in every layer, and heads of 32: vLLM's CPU attention takes no smaller);
    gpt-oss (sliding-window layers of 8 tokens alternating with full ones, attention sinks, 4 experts, 2 per
    token); Mistral (every layer sliding, 8 tokens)."""
    from transformers import GptOssConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

    base = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5 if family == "llama" else 1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "qwen3_moe":
        base.update(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    if family == "gpt_oss":
        base.update(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 3, rope_scaling=None)
    if family == "mistral":
        base.update(sliding_window=8)
    base.update(overrides)
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig,
               "mistral": MistralConfig}
    return classes[family](**base)


def build_tiny_target(out_dir: str | Path, family: str = "llama", seed: int = 0, chat_format: str = "chatml",
                      **overrides) -> Path:
    """Save a tiny randomly initialised causal LM + tokenizer to `out_dir`; return the path.

    The output head is scaled up so the next-token distribution is peaked (mean top
    probability about 0.3-0.4) instead of near uniform: drafts and acceptance tests need a
    target whose predictions have structure. Random targets still fall into short loops
    under greedy decoding; tests that need variety sample or use many prompts.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(chat_format=chat_format)
    vocab = len(tokenizer)
    config = _tiny_config(family, vocab, **overrides)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # sharper logits than the default init
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class JsonHandler(BaseHTTPRequestHandler):
    """Base of the tests' fake OpenAI-style servers: quiet, and `_send` answers with JSON."""

    def log_message(self, *args):
        return  # the test output is the assertions, not an access log

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def write_chat_rows(path: Path, rows: int) -> Path:
    """The first `rows` built-in chitchat conversations that have a reply, as a JSONL data source at `path`."""
    from eyas.data.sources import chitchat_rows

    picked = [r for r in chitchat_rows() if any(m["role"] == "assistant" for m in r["messages"])][:rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return path


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` on a loopback port in a thread; yields its base URL, stops it on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def random_head(target_dir: str | Path, kind: str, d2t=None, seed: int = 0, sharpen: bool = True, **draft):
    """(head, target, tokenizer): a randomly initialised `kind` head on the tiny target saved in `target_dir`,
    started from its embedding and lm_head; `sharpen`: q/k scaled x10 so its logits depend on positions and
    masks (a plain random head attends almost uniformly). `draft`: more draft keys (a kind's own among them)."""
    import torch  # heavy, and only the head tests need it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.draft.features import default_layers  # only the head tests need the draft packages
    from eyas.draft.registry import build_head
    from eyas.recipe_kinds import draft_config
    from eyas.targets import load_target_config, target_identity

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = load_target_config(str(target_dir))
    torch.manual_seed(seed)
    head = build_head(draft_config(kind=kind, **draft), config, default_layers(config.num_hidden_layers), d2t,
                      target_identity(config, tokenizer))
    head.init_from_target(target)
    with torch.no_grad():
        for name, param in head.named_parameters() if sharpen else ():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10.0)
    return head, target, tokenizer


def target_batch(target, sequence, aux_layers: list[int]) -> dict:
    """A training batch of token rows `sequence` [B, T] with the target's features, as the shards give it
    (the fused `aux_layers` and the last hidden state), every position in the loss."""
    import torch  # heavy, and only the head tests need it

    with torch.inference_mode():
        hidden = target(sequence, output_hidden_states=True).hidden_states
    return {"input_ids": sequence, "loss_mask": torch.ones_like(sequence),
            "aux_hidden": torch.cat([hidden[i] for i in aux_layers], dim=-1).clone(), "last_hidden": hidden[-1].clone()}
