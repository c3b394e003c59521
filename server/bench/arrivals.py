"""Request arrival times for the online load generator."""

import math
import random


def arrival_offsets(num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0):
    """Send times in seconds from the start, like `vllm bench serve --request-rate`.

    Gaps are gamma distributed with mean 1/rate; burstiness 1.0 makes them exponential,
    i.e. a Poisson process. An infinite rate sends everything at once (concurrency is then
    bounded by --max-concurrency only)."""
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if request_rate <= 0:
        raise ValueError("request_rate must be positive (inf: all at once)")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        t += rng.gammavariate(burstiness, theta)
        offsets.append(t)
    return offsets
