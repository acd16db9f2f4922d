"""`python -m eyas.train RECIPE [key=value ...]`: what `accelerate launch -m eyas.train` runs."""
import sys

from eyas.stage_cli import run_stage

sys.exit(run_stage("train", sys.argv[1:]))
