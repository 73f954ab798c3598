"""The decoding commands' choices, light enough for their parsers (no torch)."""

from __future__ import annotations

# How a partly accepted block leaves a hybrid target's linear-attention layers
# (train/decoding/target_decode.py): transformers' own recording, or a copy and a re-run.
ROLLBACKS = ("auto", "native", "rerun")
