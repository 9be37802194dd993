"""Data pipelines: WMT and user corpora to fairseq data-bin directories, and the synthetic quickstart corpus."""
