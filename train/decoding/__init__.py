"""Speculative decoding with the target in transformers: `speculate`, DDTree trees, the target's cache."""
