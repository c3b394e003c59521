"""Paged attention: a reference implementation in torch for CPU and CUDA."""
