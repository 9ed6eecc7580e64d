"""The training engines behind one seam; each owns everything engine-specific."""
