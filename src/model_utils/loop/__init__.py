"""The training loop over explicit checkpointable state, and the spike guard."""
