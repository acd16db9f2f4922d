"""vLLM plugin: eyas's per-step `mtp` drafts (one Llama layer per draft step) for dense targets.

Loaded by vLLM through the `vllm.general_plugins` entry point `eyas_mtp` (pyproject.toml);
eyas never imports this module. `register()` adds the model class `EyasLlamaMTP` to vLLM's
`ModelRegistry` and the config type of `eyas export --to vllm` to transformers' AutoConfig.

How vLLM drives it (vLLM 0.32, V1 model runner, the one CPUs run): a draft whose config has
`model_type: step3p5_mtp` gets `Step3p5MTPProposer` (`config/speculative.py` `use_step3p5_mtp`,
`v1/worker/gpu_model_runner.py`), the only V1 proposer that passes `spec_step_idx` to every
forward and to `compute_logits`. Its first pass (`spec_step_idx=0`) hands the model every token
the target has just verified, token x_{p+1} at position p with the target's hidden f_p; each
later step j hands one row per request (the token drafted by step j-1, at position M+j-1).
vLLM's own Step3p5 model runs only layer j in step j; eyas's layers need more, and this class
does it itself:

- first pass: every layer k < K runs over the new positions p >= k (layer k's entry at
  position p reads token x_{p+1} and the feature of slot p-k: layer k-1's output at p-1 with
  `mtp_feed: chain`, the target's f_{p-k} with `mtp_feed: target`), so each layer's cache holds
  exactly the committed entries `eyas eval` (`eval/head_draft.py` `PerStepDraft`) keeps;
- draft step j: layers j..K-1 run at position M+j-1 (a wavefront: layer k's rows at positions
  M..M+k-1 are the drafted-path rows `PerStepDraft.expand` computes for depth k), and the row
  of layer j gives the logits of step j.

The features a position reads from before the current forward (the hidden of position p-1, the
target's f_{p-k}) and each layer's keys/values are kept per KV-cache slot, in buffers indexed by
the slot vLLM assigns to a request's position (`slot = block_table[req, p // B] * B + p % B`).
Attention is computed here over those buffers with eyas's mask (layer k never sees positions
< k, which have no entry in eyas), so the mask cannot differ from eyas's whatever the backend;
vLLM's paged KV of the one attention layer this model registers is what allocates the slots and
builds the metadata (block tables, query/sequence bounds) that the buffers are indexed by.
Blocks vLLM shares between requests (prefix caching) carry the same entries, since every entry
is a function of the tokens and target features before it.

Embedding: the target's (the proposer shares it). lm_head: the target's, through the shared
embedding when the target ties them (`eyas.lm_head: "tied"`), else the export's `lm_head.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "EyasLlamaMTP"
# The draft model_type vLLM 0.32 keys its per-step MTP proposer on (SpeculativeConfig.use_step3p5_mtp).
MODEL_TYPE = "step3p5_mtp"
FEEDS = ("chain", "target")


def register() -> None:
    """The `vllm.general_plugins` entry point: make vLLM able to load `eyas export --to vllm` mtp drafts."""
    from transformers import AutoConfig, PretrainedConfig
    from vllm import ModelRegistry

    class EyasMTPConfig(PretrainedConfig):
        """The config.json of an eyas mtp export (plain fields; written by `_vllm_config` in eyas/draft/mtp.py)."""
        model_type = MODEL_TYPE

    try:
        AutoConfig.register(MODEL_TYPE, EyasMTPConfig)
    except ValueError:  # already registered (plugins load once per process, maybe more)
        pass
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "eyas.serving.vllm_mtp:EyasLlamaMTP")


def _eyas_block(hf_config) -> dict:
    block = getattr(hf_config, "eyas", None) or {}
    return dict(block) if isinstance(block, dict) else {}


class _Layer(nn.Module):
    """One eyas MTPLayer (eyas/draft/blocks.py) plus its final norm, under the export's names."""

    def __init__(self, cfg, llama_cfg) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        bias = bool(getattr(cfg, "attention_bias", False))
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.enorm, self.hnorm = LlamaRMSNorm(h, eps=eps), LlamaRMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.self_attn.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(llama_cfg)
        self.final_layernorm = LlamaRMSNorm(h, eps=eps)


class _Predictor(nn.Module):
    """`model.*`: the per-step layers under `model.mtp.layers.{k}`; `embed_tokens` is set by vLLM
    (the target's); `kv` is the attention layer whose paged cache gives the slots."""

    def __init__(self, cfg, llama_cfg, vllm_config, num_target_layers: int) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList([_Layer(cfg, llama_cfg) for _ in range(int(cfg.num_nextn_predict_layers))])
        self.kv_layer_name = f"model.layers.{num_target_layers}.self_attn.attn"
        self.kv = Attention(cfg.num_attention_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                            num_kv_heads=cfg.num_key_value_heads, cache_config=vllm_config.cache_config,
                            prefix=self.kv_layer_name)


class EyasLlamaMTP(nn.Module):
    """eyas's per-step MTP head served by vLLM's Step3p5MTPProposer (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        spec = vllm_config.speculative_config
        cfg = spec.draft_model_config.hf_config if spec is not None else vllm_config.model_config.hf_config
        eyas = _eyas_block(cfg)
        self.config = cfg
        self.feed = eyas.get("mtp_feed", "chain")
        if self.feed not in FEEDS:
            raise ValueError(f"eyas mtp export: mtp_feed '{self.feed}' is not one of {FEEDS}; "
                             "re-export the draft with eyas export")
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise ValueError("eyas mtp plugin: vLLM chose Model Runner V2, whose MultiModuleMTPSpeculator calls the "
                             "draft with another contract (every module over the whole chunk each step) than the V1 "
                             "Step3p5MTPProposer this plugin implements; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0")
        self.num_layers = int(cfg.num_nextn_predict_layers)
        self.steps = int(spec.num_speculative_tokens) if spec is not None else self.num_layers
        if self.steps > self.num_layers:
            raise ValueError(f"eyas mtp draft has {self.num_layers} layers (one per draft step); "
                             f"num_speculative_tokens={self.steps} would reuse a layer for a step it was not "
                             f"trained for: set num_speculative_tokens <= {self.num_layers}")
        rope = dict(eyas.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(cfg.rope_theta)})
        llama_cfg = LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
            rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope, max_position_embeddings=cfg.max_position_embeddings,
            attention_bias=bool(getattr(cfg, "attention_bias", False)), mlp_bias=False)
        self.tied = eyas.get("lm_head", "tied") == "tied"
        self.vocab_size = int(cfg.vocab_size)
        target_layers = int(eyas.get("target_hidden_layers") or cfg.num_hidden_layers)
        self.model = _Predictor(cfg, llama_cfg, vllm_config, target_layers)
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(llama_cfg)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._buffers_by_name: dict[str, torch.Tensor] = {}
        self._slots = 0
        print(f"EYAS_MTP_INIT layers={self.num_layers} steps={self.steps} feed={self.feed} "
              f"lm_head={'tied' if self.tied else 'own'}", flush=True)

    # ---- the interface vLLM's proposer calls ------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        layer = self._layer(spec_step_idx)
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(layer.final_layernorm(hidden_states), weight[: self.vocab_size])

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0) -> torch.Tensor:
        out = torch.zeros(positions.shape[0], self.config.hidden_size, dtype=hidden_states.dtype,
                          device=hidden_states.device)
        meta = self._metadata()
        if meta is None or input_ids is None:  # profiling / dummy runs: nothing to attend to
            return out
        n = int(meta.query_start_loc[-1])
        if n == 0:
            return out
        starts = meta.query_start_loc.to(positions.device).long()
        req = torch.searchsorted(starts[1:], torch.arange(n, device=positions.device), right=True)
        pos = positions[:n].long()
        tables = (getattr(meta, "block_table", None) if getattr(meta, "block_table", None) is not None
                  else meta.block_table_tensor).long()
        slots = meta.slot_mapping[:n].long()
        self._check_slots(tables, req, pos, slots)
        self._ensure_buffers(tables, hidden_states.dtype, hidden_states.device)
        embeds = self.model.embed_tokens(input_ids[:n])
        step = int(spec_step_idx)
        if step == 0:
            self._write("feature", slots, hidden_states[:n])
        first = 0 if step == 0 else step
        for k in range(first, self.steps):
            rows = (pos >= k).nonzero().flatten()
            if rows.numel() == 0:
                continue
            if k == 0:
                feature = hidden_states[:n][rows]
            elif self.feed == "chain":
                feature = self._read(f"hidden{k - 1}", self._slot(tables, req[rows], pos[rows] - 1))
            else:
                feature = self._read("feature", self._slot(tables, req[rows], pos[rows] - k))
            hidden = self._run_layer(k, embeds[rows], feature, pos[rows], req[rows], slots[rows], tables)
            self._write(f"hidden{k}", slots[rows], hidden)
            if k == step:
                out[rows] = hidden.to(out.dtype)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every tensor of the export by its own name; an unknown one is an error (vLLM's loader
        then reports any parameter left unloaded)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"eyas mtp export: unexpected tensor '{name}' (this plugin reads "
                                 f"model.mtp.layers.{{k}}.* and, for untied targets, lm_head.weight)")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"eyas mtp export: tensor '{name}' has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        print(f"EYAS_MTP_LOADED tensors={len(loaded)} missing={len(missing)}"
              + (f" first_missing={missing[0]}" if missing else ""), flush=True)
        return loaded

    # ---- internals ---------------------------------------------------------------------------------

    def _layer(self, step: int) -> _Layer:
        if not 0 <= step < self.num_layers:
            raise ValueError(f"eyas mtp draft has {self.num_layers} layers; draft step {step} does not exist")
        return self.model.mtp.layers[step]

    def _metadata(self):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            return meta.get(self.model.kv_layer_name)
        return None

    def _slot(self, tables: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        size = self.block_size
        return tables[req, torch.div(pos, size, rounding_mode="floor")] * size + pos % size

    def _check_slots(self, tables, req, pos, slots) -> None:
        """The slot formula must reproduce vLLM's slot mapping (else the block size is another one)."""
        valid = slots >= 0
        if not bool(valid.any()):
            return
        for size in [self.block_size] + [s for s in (16, 32, 64, 128, 256, 512, 1024) if s != self.block_size]:
            if int(pos[valid].max()) // size >= tables.shape[1]:
                continue
            got = tables[req[valid], torch.div(pos[valid], size, rounding_mode="floor")] * size + pos[valid] % size
            if torch.equal(got, slots[valid]):
                self.block_size = size
                return
        raise RuntimeError("eyas mtp plugin: cannot reproduce vLLM's slot mapping from its block table; "
                           "this vLLM version lays out its KV cache in a way the plugin does not know")

    def _ensure_buffers(self, tables: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        need = (int(tables.max()) + 1) * self.block_size if tables.numel() else self.block_size
        if need <= self._slots and self._buffers_by_name:
            return
        size = max(need, 2 * self._slots)
        kv = self.config.num_key_value_heads * self.config.head_dim
        widths = {"feature": self.config.hidden_size}
        for k in range(self.steps):
            widths.update({f"hidden{k}": self.config.hidden_size, f"key{k}": kv, f"value{k}": kv})
        for name, width in widths.items():
            fresh = torch.zeros(size, width, dtype=dtype, device=device)
            old = self._buffers_by_name.get(name)
            if old is not None:
                fresh[: old.shape[0]] = old
            self._buffers_by_name[name] = fresh
        self._slots = size

    def _write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        keep = slots >= 0
        self._buffers_by_name[name][slots[keep]] = values[keep].to(self._buffers_by_name[name].dtype)

    def _read(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        return self._buffers_by_name[name][slots]

    def _run_layer(self, k, embeds, feature, pos, req, slots, tables) -> torch.Tensor:
        """eyas's MTPLayer k over rows (one token each) with attention over layer k's entries
        at positions k..p of the row's request (eyas's mask: causal, no entry below position k)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self._layer(k)
        feature = feature.to(embeds.dtype)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(feature)], dim=-1))
        a = layer.input_layernorm(x)
        rows = a.shape[0]
        attn = layer.self_attn
        q = attn.q_proj(a).view(1, rows, layer.num_heads, layer.head_dim).transpose(1, 2)
        key = attn.k_proj(a).view(1, rows, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
        value = attn.v_proj(a).view(1, rows, layer.num_kv_heads, layer.head_dim)
        cos, sin = self.rotary_emb(a[None], pos[None])
        q, key = apply_rotary_pos_emb(q, key, cos, sin)
        flat = layer.num_kv_heads * layer.head_dim
        self._write(f"key{k}", slots, key.transpose(1, 2).reshape(rows, flat))
        self._write(f"value{k}", slots, value.reshape(rows, flat))
        out = torch.empty(rows, layer.num_heads * layer.head_dim, dtype=a.dtype, device=a.device)
        for r in torch.unique(req).tolist():
            mine = (req == r).nonzero().flatten()
            top = int(pos[mine].max())
            key_pos = torch.arange(k, top + 1, device=pos.device)
            key_slots = self._slot(tables, torch.full_like(key_pos, r), key_pos)
            keys = self._read(f"key{k}", key_slots).view(1, -1, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
            values = self._read(f"value{k}", key_slots).view(1, -1, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
            mask = key_pos[None, :] <= pos[mine][:, None]
            o = F.scaled_dot_product_attention(q[:, :, mine], keys, values, attn_mask=mask[None, None],
                                               scale=layer.head_dim ** -0.5, enable_gqa=True)
            out[mine] = o.transpose(1, 2).reshape(mine.numel(), -1)
        h = x + attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))
