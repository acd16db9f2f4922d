"""Data stage: chat sources, templates and loss masks (prepare), hidden-state shards (dump)."""
