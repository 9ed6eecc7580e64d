"""The model: its source and hub snapshot, LoRA adapters, activation checkpointing, kernels."""
