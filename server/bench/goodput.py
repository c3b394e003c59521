"""Service-level objectives and goodput, as in `vllm bench serve --goodput`: a request is
good when every metric named in the SLO is at or under its bound."""

from collections.abc import Iterable

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft:500,tpot:50' (or space separated, vLLM's form) -> {'ttft': 0.5, 'tpot': 0.05},
    bounds in seconds."""
    if not text:
        return {}
    slo = {}
    for item in text.replace(",", " ").split():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO item {item!r} must be NAME:MS with NAME in {SLO_METRICS}")
        bound_ms = float(value)
        if bound_ms <= 0:
            raise ValueError(f"SLO bound must be positive, got {item!r}")
        slo[name] = bound_ms / 1000.0
    return slo


def meets_slo(metrics: dict[str, float], slo: dict[str, float]) -> bool:
    """`metrics` holds the request's ttft, tpot and e2el in seconds."""
    return all(metrics[name] <= bound for name, bound in slo.items())


def goodput(
    requests: Iterable[dict[str, float]], slo: dict[str, float], duration_s: float
) -> float:
    """Good requests per second. Without an SLO every completed request counts."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    return sum(1 for r in requests if meets_slo(r, slo)) / duration_s
