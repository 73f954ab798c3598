"""The block-diffusion family: DFlash and DFlash 2 (`variants`). The network (`model`,
`dflash2`, the one attention rule, anchors, the decode-time cache) and what it is
trained to minimise (`targets`, the chunked `loss`, the selector's `selector_loss`,
joined by `step`)."""
