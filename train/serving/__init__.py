"""Serving the export in vLLM beside local decoding: `serve-check` and the vLLM subprocess it runs."""
