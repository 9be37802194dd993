"""Analyses of trained checkpoints, importable (the multipath-inspect CLI calls them)."""
