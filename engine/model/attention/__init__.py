"""Attention over the serving KV cache: a plain-PyTorch reference backend and a Triton paged-kernel backend."""
