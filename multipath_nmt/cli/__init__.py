"""Command-line tools: thin wrappers over importable functions."""
