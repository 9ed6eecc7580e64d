"""What the launchers hand a rank: its variables, the process group, signals, the time limit, quiet imports."""
