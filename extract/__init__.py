"""`python -m extract`: corpus -> plan -> hidden-state store. The corpus code sits at
this level, the one job framework in `jobs/`, the two jobs beside each other in
`extraction/` (hidden states) and `generate/` (the target's own replies)."""
