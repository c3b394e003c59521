"""Benchmarks: offline comparison, online load generator and sweeps."""
