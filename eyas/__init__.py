"""eyas: train speculative-decoding draft heads (EAGLE, EAGLE-3, multi-layer MTP, P-EAGLE, DFlash, DSpark).

Stages live in their own packages: `eyas.data` (prepare, dump, shards), `eyas.train`
(losses, loop, export), `eyas.eval` (tree speculative decoder and reports); the front door,
the `eyas` command, is the package `eyas.cli` (the cli/ folder). Shared pieces live here:
`eyas.config` (reading and writing recipes; the schema, its checks, the kind rules and the
docs generator beside it in `eyas.recipe_*`), `eyas.draft` (the head kinds, one file each, and their registry),
`eyas.targets` (loading the target model).
"""

from eyas.errors import EyasError

__version__ = "0.1.0"
__all__ = ["EyasError", "__version__"]
