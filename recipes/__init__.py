"""Recipes shipped with eyas (YAML), found by `eyas quickstart` and the docs."""
