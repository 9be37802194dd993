"""Oracles for tests and the benchmark: readable reference forms of the fused modules."""
