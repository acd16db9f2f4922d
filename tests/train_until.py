"""`python tests/train_until.py STOP RECIPE [key=value ...]`: train as `eyas train` does, but stop as if
preempted once optimizer step STOP is done (checkpoint, exit 0). Launchable by torchrun and
accelerate launch, so multi-process tests can stop a run at an exact step."""

from __future__ import annotations

import sys

from eyas.config import load_recipe
from eyas.train.loop import train

if __name__ == "__main__":
    stop, path, *overrides = sys.argv[1:]
    result = train(load_recipe(path, overrides), stop_at_step=int(stop))
    print(f"train_until: {result['outcome']} at step {result['step']}")
