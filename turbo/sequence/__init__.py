"""One sequence's generation: its options, the driver and its rounds (draft, verify, accept,
roll back), the draft policy and the adaptive chooser, sampling, penalties, grammars, stops,
log-probabilities, detokenizing, the stats and the kept states (state_cache)."""
