"""What the trainer reads: the streaming shard loader, lanes, the held-out split, prompts."""
