"""Reading a finished or running fit: plateaus, LR, comparisons, plots."""
