"""Work on a whole store: verify (locally or over a Ray cluster), recompute the layer
statistics, copy to local disk, transcode."""
