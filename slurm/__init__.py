"""The front door's SLURM side: job templates and `eyas submit`, which chains the stages on a cluster."""
