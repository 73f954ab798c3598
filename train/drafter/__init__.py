"""The drafter network: its Qwen3 layers, the one attention rule, anchors, decode-time cache."""
