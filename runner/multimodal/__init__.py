"""Multimodal inputs: the encoder protocol, placeholder expansion, the encoder cache, and the
per-step state that tells the worker which encoder rows go where (and M-RoPE positions)."""
