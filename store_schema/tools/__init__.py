"""Work on a whole store: verify (locally or over a Ray cluster), repair, recompute
the layer statistics, copy to local disk."""
