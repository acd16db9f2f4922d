"""The draft model, shared by train, eval and export.

- `config`: `HeadConfig`, the typed, versioned head config (`config.json`).
- `blocks`: attention, norms and decoder layers every kind is built from.
- `head`: `DraftHead`, what every kind shares and the attributes each kind declares.
- `eagle`, `eagle3`, `mtp`: one class per head kind.
- `registry`: kind name -> class; `build_head`, `head_from_config`.
- `checkpoint`: draft directories (`save_draft`, `load_draft`).
"""
