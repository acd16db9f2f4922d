"""SLURM templates and `eyas submit`."""
