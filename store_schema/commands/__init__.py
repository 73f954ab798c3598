"""The handlers of `python -m store_schema`, one per command (`run(args) -> int`)."""
