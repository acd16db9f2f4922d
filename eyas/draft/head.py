"""`DraftHead`: what every head kind shares, and what each kind declares about itself.

A kind is one subclass in its own file (`eagle.py`, `eagle3.py`, `mtp.py`, ...) listed in
`eyas.draft.registry`. It builds its own layers in `_build`, says how it reads the target's
features (`project`) and runs one draft step (`step`); its drafting layout (`layout`, which the kind's
class declares and its registry line repeats for the torch-free recipe checks: a class whose layout is
not its line's is refused when it is defined) tells every stage how it drafts, and the class attributes
and the overridable methods below tell the dump, the trainer, the eval adapter and the exporter
everything else they need (its feature spec, `eyas.draft.features`; its export mapping,
`eyas.draft.formats`; its layers, `decoder_layers`; its feature projection, `projection`; its final
norms, `final_norms`), so none of them branches on the kind's name or a flag, nor probes the head for
an attribute (docs/heads.md, "Adding a head kind").

Semantics (EAGLE): at position t the head reads the feature f_t (the target's hidden state
at t for step 0) and the embedding of token x_{t+1}, and predicts x_{t+2}. Step k > 0 reads
the previous step's output hidden as its feature (or the target's f_t again, for `mtp` with
target feed) and the embedding of the token it drafted.

Frozen parts (the target's embedding, and its lm_head unless the kind trains it) have
requires_grad=False; `trainable_parameters()` lists the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from eyas.draft.blocks import rotary_embedding
from eyas.draft.config import HeadConfig, target_shapes
from eyas.draft.features import LAST_HIDDEN, FeatureSpec
from eyas.draft.formats import KindExport
from eyas.draft.kinds import KindRules
from eyas.draft.layouts import Layout
from eyas.draft.registry import KINDS
from eyas.errors import EyasError


class DraftHead(nn.Module):
    """The shared part of a draft head; see the module docstring."""

    kind: ClassVar[str]
    # the target feature step 0 reads, as the dump writes it and the trainer checks it
    feature_spec: ClassVar[FeatureSpec] = LAST_HIDDEN
    # its batch / manifest key ("aux_hidden" or "last_hidden"), always `feature_spec.name`
    feature: ClassVar[str] = LAST_HIDDEN.name
    # how it drafts: every kind declares it in its own class, and its registry line (`eyas.draft.registry`)
    # names the same (the recipe checks read the line without importing torch); the stages ask it, never the kind
    layout: ClassVar[Layout]
    # its recipe rules and options (`eyas.draft.kinds`)
    rules: ClassVar[KindRules] = KindRules()
    # the token a step k > 0 reads in training: its own drafted token ("draft") or the data's ("data")
    default_token_feed: ClassVar[str] = "draft"
    # may predict over the reduced draft vocabulary (d2t/t2d); else always the target's full one
    supports_draft_vocab: ClassVar[bool] = False
    # what `eyas export` writes it as, per engine format (names, shapes, config.json, serving)
    export: ClassVar[KindExport]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.feature = cls.feature_spec.name  # one source: the spec the kind declares
        kind = cls.__dict__.get("kind")
        if kind in KINDS:  # a registered kind declares its layout itself, the one its registry line names
            declared, line = cls.__dict__.get("layout"), KINDS[kind].layout
            if declared is not line:
                raise EyasError(f"{cls.__module__}.{cls.__name__} (kind '{kind}') should declare layout = "
                                f"{line.name.upper()} in its own class, as its line in eyas/draft/registry.py names it; "
                                f"it declares {'none' if declared is None else declared}")

    def __init__(self, cfg: HeadConfig, d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self._build(cfg)  # registration order = init order: embedding, kind layers, rotary
        self.rotary_emb = rotary_embedding(cfg)
        self._init_weights(cfg.initializer_range)
        self.embed_tokens.requires_grad_(False)
        if not cfg.train_lm_head:
            self.lm_head.requires_grad_(False)
        self.register_buffer("d2t", None)  # None buffers stay out of the state_dict
        self.register_buffer("t2d", None)
        if cfg.reduced_vocab:
            self._set_vocab_maps(d2t, cfg.vocab_size, cfg.draft_vocab_size)

    # ---- what a kind provides -------------------------------------------------------------------

    @classmethod
    def head_config(cls, draft_cfg: Any, target_config: Any, aux_layers: list[int],
                    draft_vocab_size: int | None, target_identity: str) -> HeadConfig:
        """This kind's HeadConfig for a recipe's `draft` section on a target."""
        shapes = target_shapes(target_config)
        vocab = shapes["vocab_size"]
        if not cls.supports_draft_vocab or not draft_vocab_size or draft_vocab_size >= vocab:
            draft_vocab_size = vocab
        shapes["intermediate_size"] = int(draft_cfg.intermediate_size or shapes["intermediate_size"])
        if not cls.rules.attention_bias_from_target:
            shapes.update(qkv_bias=False, o_bias=False)
        # the kind's layer variants, from their recipe switches (off when the section lacks them)
        options = draft_cfg.options
        variants = {v.field: bool(options.get(v.recipe_key, False)) for v in cls.rules.variants}
        # mtp_feed: read by mtp alone (its option, `MTPHead.head_config`); every other head records the recipe
        # default it recorded before kind options, so its config.json stays the same
        return HeadConfig(kind=cls.kind, num_layers=cls.layers_for(draft_cfg), num_steps=int(draft_cfg.num_steps),
                          mtp_feed="chain", aux_layers=list(aux_layers or []),
                          draft_vocab_size=int(draft_vocab_size), target_identity=target_identity,
                          train_lm_head=cls.trains_lm_head(draft_cfg), **variants, **shapes)

    @classmethod
    def layers_for(cls, draft_cfg: Any) -> int:
        return 1

    @classmethod
    def recipe_options(cls, draft_cfg: Any) -> Any:
        """The kind's own recipe keys (its `rules.options` dataclass): those the recipe set, defaults for the rest."""
        if cls.rules.options is None:
            return None
        return cls.rules.options(**draft_cfg.options)

    @classmethod
    def trains_lm_head(cls, draft_cfg: Any) -> bool:
        """Whether the lm_head trains: the kind's rule, and then the recipe's `draft.train_lm_head`."""
        return cls.rules.trains_lm_head and bool(getattr(draft_cfg, "train_lm_head", True))

    def _build(self, cfg: HeadConfig) -> None:
        raise NotImplementedError

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The step-0 feature from what the dump stored (identity unless the kind fuses layers)."""
        return features

    def step(self, k: int, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, past_key_values: Any = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (hidden [B,T,H] pre-final-norm, fed to the next step; logits [B,T,V_draft]).

        `k` is the draft step (it selects the layer of a per-step kind). `attention_mask`: None =
        causal over the given tokens (continuing `past_key_values` if it holds any), or a 4D
        bool/additive mask [B,1,T,S] with S = cached + new. `past_key_values`: a transformers
        Cache (e.g. DynamicCache), or a `TTTCache` for the training-time-test unroll.
        """
        raise NotImplementedError

    @classmethod
    def unroll_steps(cls, ttt_steps: int) -> int:
        """The draft steps one training forward unrolls for `train.ttt_steps` (the held-out eval unrolls all)."""
        return ttt_steps

    def next_feature(self, hidden: torch.Tensor, target_feature: torch.Tensor) -> torch.Tensor:
        """The feature step k+1 reads, from step k's output `hidden` and step 0's (the target's) feature."""
        return hidden

    def feature_loss_sum(self, hidden: torch.Tensor, last_hidden: torch.Tensor, loss_mask: torch.Tensor
                         ) -> torch.Tensor | None:
        """A loss on step 0's output hidden besides the token loss, summed over the loss mask (None: the kind
        has none; EAGLE-1 regresses the target's next feature)."""
        return None

    def max_depth(self) -> int | None:
        """The deepest draft step this head can make (None: any, one layer serves every step)."""
        return None

    def decoder_layers(self) -> list[nn.Module]:
        """Its decoder layers (each an attention and an MLP; `layers`, unless the kind keeps them elsewhere): what
        `train.draft_init=target_last_layer` starts from the target's layer and the memory plan counts per step."""
        return list(self.layers)

    @property
    def projection(self) -> nn.Linear | None:
        """The Linear that makes a step's feature from the target's (eagle3's fc over the fused layers; EAGLE-1's
        over [embedding; feature]), which the memory plan counts once per unroll; None where the kind has none."""
        return None

    def final_norms(self) -> list[nn.Module]:
        """The norms that take the target's final norm weight at initialisation."""
        return []

    # ---- shared -----------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def step_inputs(self, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every kind's `step` starts from: (token embeddings, the feature in their dtype, RoPE cos, sin)."""
        embeds = self.embed_tokens(input_ids)
        feature = feature.to(embeds.dtype)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        cos, sin = self.rotary_emb(feature, position_ids)
        return embeds, feature, cos, sin

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity without a reduced vocabulary)."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def _set_vocab_maps(self, d2t: torch.Tensor | None, vocab: int, draft_vocab: int) -> None:
        if d2t is None:
            raise EyasError("a reduced draft vocabulary needs its d2t map (run `eyas dump`, which writes vocab.safetensors)")
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        if d2t.numel() != draft_vocab:
            raise EyasError(f"the d2t map has {d2t.numel()} entries but the head's draft vocabulary has {draft_vocab}")
        target_ids = torch.arange(draft_vocab) + d2t
        if target_ids.min() < 0 or target_ids.max() >= vocab:
            raise EyasError(f"the d2t map points outside the target vocabulary (size {vocab}); rebuild it with `eyas dump`")
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def _init_weights(self, std: float) -> None:
        """HF-style init: normal(0, initializer_range) weights, zero biases, unit norms (seeded by the caller)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def init_from_target(self, target_model: nn.Module) -> DraftHead:
        """Copy (and freeze) the target's embedding, lm_head and final norm into the head."""
        base = getattr(target_model, "model", target_model)
        norm = getattr(base, "norm", None)
        return self.init_from_target_weights(target_model.get_input_embeddings().weight,
                                             target_model.get_output_embeddings().weight,
                                             None if norm is None else norm.weight)

    @torch.no_grad()
    def init_from_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor,
                                 norm: torch.Tensor | None) -> DraftHead:
        """The same from bare tensors (the trainer reads them from the target's safetensors)."""
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        for name, w in (("embedding", embed), ("lm_head", lm_head)):
            if tuple(w.shape) != (vocab, hidden):
                raise EyasError(f"the target's {name} is {tuple(w.shape)}, the head expects {(vocab, hidden)}; "
                                "is draft built for another target?")
        self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
        rows = torch.arange(vocab) if self.d2t is None else self.draft_to_target(torch.arange(self.draft_vocab_size))
        self.lm_head.weight.copy_(lm_head[rows.to(lm_head.device)].to(self.lm_head.weight.dtype))
        if norm is not None:
            for final_norm in self.final_norms():
                final_norm.weight.copy_(norm)
        return self


def with_mask_token(cfg: HeadConfig, mask: int) -> HeadConfig:
    """`cfg` with the recipe's `draft.mask_token_id` `mask` (-1: the target's last id), for kinds that draft in
    parallel."""
    if mask >= cfg.vocab_size:
        raise EyasError(f"recipe key 'draft.mask_token_id' is {mask}, outside the target's vocabulary "
                        f"(size {cfg.vocab_size}); choose an id below it, or -1 for the last one")
    return dataclasses.replace(cfg, mask_token_id=mask if mask >= 0 else cfg.vocab_size - 1)


# A draft layer's tensor that starts from a target layer tensor of another name: EAGLE-3 normalises
# the feature with `hidden_norm` where the target normalises its layer input with `input_layernorm`.
_TARGET_LAYER_ALIASES = {"hidden_norm.weight": "input_layernorm.weight"}


@torch.no_grad()
def init_layers_from_target(head: DraftHead, target_layer: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Start every decoder layer of the head from a target decoder layer where the shapes allow.

    `target_layer`: tensors named as inside the layer (`self_attn.o_proj.weight`). A tensor of the
    same name and shape is copied; EAGLE-3's q/k/v read concat(embedding, feature) [out, 2H], so
    the target's [out, H] projection goes into the feature half (the feature is the target's own
    hidden state, which that projection was trained on) and the embedding half keeps its random
    init. Tensors the target layer lacks (fc, eh_proj, MTP's enorm/hnorm) or of another shape (a
    narrower `draft.intermediate_size`) keep theirs. Returns (copied, kept) parameter names.
    """
    copied, kept = [], []
    layers = {id(layer) for layer in head.decoder_layers()}
    for prefix, module in head.named_modules():
        if id(module) not in layers:
            continue
        for local, param in module.named_parameters():
            name = f"{prefix}.{local}"
            source = target_layer.get(_TARGET_LAYER_ALIASES.get(local, local))
            if source is not None and source.shape == param.shape:
                param.copy_(source.to(param.dtype))
                copied.append(name)
            elif source is not None and param.dim() == 2 and param.shape == (source.shape[0], 2 * source.shape[1]):
                param[:, source.shape[1]:].copy_(source.to(param.dtype))
                copied.append(f"{name} (feature half)")
            else:
                kept.append(name)
    return copied, kept


def count_parameters(head: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in head.parameters())
    return sum(p.numel() for p in head.parameters() if p.requires_grad), total
