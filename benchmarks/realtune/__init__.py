"""The parts of benchmarks/tune.py: the load, the machine, the report."""
