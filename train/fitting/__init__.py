"""Fitting a drafter: the loop, one step, the loss, checkpoints, DDP, schedule, logs."""
