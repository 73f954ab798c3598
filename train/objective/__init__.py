"""What a drafter is trained to minimise: one step's anchors, labels and weights
(`targets`), the chunked loss through the target's frozen head (`loss`, `target_head`),
the DFlash 2 selector's K-way loss (`selector_loss`), and the step that joins them
(`step`). The loop that drives it is `train.fitting`."""
