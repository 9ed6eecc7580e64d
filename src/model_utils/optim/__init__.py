"""Optimizer and lr-schedule settings both engines train with, and the weight-decay groups."""
