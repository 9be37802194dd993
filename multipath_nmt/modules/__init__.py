"""Plain PyTorch modules; none of them imports fairseq."""
