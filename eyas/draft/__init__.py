"""The draft model, shared by train, eval and export.

- `config`: `HeadConfig`, the typed, versioned head config (`config.json`).
- `blocks`: attention, norms and decoder layers the unrolled kinds are built from.
- `head`: `DraftHead`, what every kind shares and the attributes each kind declares (its layout among them).
- `layouts`: the ways a head drafts (`shared_layer`, `parallel_slots`, `layer_per_step`, `block`).
- `eagle`, `eagle3`, `mtp`, `peagle`, `dflash`, `dspark`: one file per head kind, each its `DraftHead` subclass,
  recipe options and export mapping.
- `block_layout`: `BlockHead`, the block layout's backbone and contract, which dflash and dspark subclass.
- `kinds`: `KindRules`, a kind's recipe rules and own options; `features`: the target feature a kind reads;
  `formats`: what an export writes per engine format.
- `registry`: kind name -> module and layout (torch-free); `build_head`.
- `checkpoint`: draft directories (`save_draft`, `load_draft`, `head_from_config`).
- `ttt_attention`: the training-time-test attention the unroll runs.
"""
