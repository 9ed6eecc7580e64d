"""dskit: training utilities for DeepSpeed ZeRO on SLURM."""
