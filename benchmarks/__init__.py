"""Benchmarks and the closed-loop simulator; not part of the installed package."""
