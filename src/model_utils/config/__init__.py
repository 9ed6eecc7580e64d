"""The typed config tree: flags, run files and model presets, parsed once and frozen."""
