"""eyas: train speculative-decoding draft heads (EAGLE, EAGLE-3, multi-layer MTP).

Stages live in their own packages: `eyas.data` (prepare, dump, shards), `eyas.train`
(heads, losses, loop, export), `eyas.eval` (tree speculative decoder and reports).
Shared pieces live here: `eyas.config` (typed recipes), `eyas.targets` (loading the
target model), `eyas.cli` (the `eyas` command).
"""

from eyas.errors import EyasError

__version__ = "0.1.0"
__all__ = ["EyasError", "__version__"]
