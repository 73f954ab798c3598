"""How well a drafter drafts: acceptance metrics, stored-sample eval, speculative decoding."""
