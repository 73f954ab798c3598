"""Offline acceptance: the run config's `eval` section and `python -m train eval` over a store's held-out replies."""
