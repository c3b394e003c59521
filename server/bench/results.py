"""Aggregate per-request timings into `vllm bench serve`'s result keys."""

from batchpilot.server.bench.client import RequestResult
from batchpilot.server.bench.goodput import goodput
from batchpilot.server.bench.stats import summarize

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def request_metrics(r: RequestResult) -> dict[str, float]:
    """The quantities SLOs bound, in seconds; a one-token output has no TPOT, so it cannot
    miss a TPOT bound."""
    return {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}


def aggregate(
    results: list[RequestResult],
    duration_s: float,
    slo: dict[str, float],
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> dict:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_len for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    out = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "request_goodput": goodput((request_metrics(r) for r in done), slo, duration_s),
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo_ms": {name: bound * 1000.0 for name, bound in slo.items()},
    }
    out.update(summarize([r.ttft for r in done], "ttft", percentiles))
    out.update(summarize([r.tpot for r in done if r.tpot is not None], "tpot", percentiles))
    out.update(summarize([gap for r in done for gap in r.itl], "itl", percentiles))
    out.update(summarize([r.latency for r in done], "e2el", percentiles))
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itl for r in results]
    out["errors"] = [r.error for r in results]
    return out
