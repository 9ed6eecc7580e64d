"""What a run reports: the log line, metrics, trackers, the profiler."""
