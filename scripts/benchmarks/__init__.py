"""The comparisons of `scripts/benchmark.py`, one module per kind."""
