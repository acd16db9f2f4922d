"""`python -m eyas.data prepare|dump RECIPE [key=value ...]` (also `python -m eyas.data.dump RECIPE`)."""
import sys

from eyas.stage_cli import run_stage

if len(sys.argv) < 2 or sys.argv[1] not in ("prepare", "dump"):
    print("usage: python -m eyas.data prepare|dump RECIPE [section.key=value ...]", file=sys.stderr)
    sys.exit(2)
sys.exit(run_stage(sys.argv[1], sys.argv[2:]))
