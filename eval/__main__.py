"""`python -m eyas.eval RECIPE [key=value ...]`."""
import sys

from eyas.stage_cli import run_stage

sys.exit(run_stage("eval", sys.argv[1:]))
