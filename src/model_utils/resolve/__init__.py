"""Everything derived from the config, once, into a frozen run: settings, batch layout, memory model."""
