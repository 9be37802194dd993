"""Drivers shared by tests: fairseq-train runs (crash-resume, distributed, determinism) and models
built as fairseq-train builds them."""
