"""Paged KV cache: block pool, swap space and the per-layer KV tensors."""
