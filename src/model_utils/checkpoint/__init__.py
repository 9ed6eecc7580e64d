"""The crash-safe checkpoint protocol over the engines, and the launch record it keeps."""
