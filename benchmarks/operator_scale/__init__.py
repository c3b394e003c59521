"""The operator at scale: N InferenceServices of R replicas on the loopback control plane
(tests/k8s/cluster.py), their /metrics and admin API answered by one local process, the
operator run as its own process. `python -m benchmarks.operator_scale --services N`."""
