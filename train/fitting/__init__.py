"""Fitting a drafter: the loop, checkpoints, DDP, the optimizer and schedule, logs
(what it minimises is `train.families.dflash`)."""
