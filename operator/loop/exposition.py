"""What the loop reads of a replica's /metrics: the families, and a cut of the exposition
to their lines before it is parsed."""

from __future__ import annotations

from batchpilot import names

GAUGES = (
    names.NUM_REQUESTS_WAITING,
    names.NUM_REQUESTS_RUNNING,
    names.NUM_REQUESTS_SWAPPED,
    names.KV_CACHE_USAGE,
    names.MAX_NUM_SEQS_METRIC,
    names.MAX_NUM_BATCHED_TOKENS_METRIC,
    names.OLDEST_WAITING_SECONDS,
)
COUNTERS = (
    names.NUM_PREEMPTIONS,
    names.SWAPS_OUT,
    names.GENERATION_TOKENS,
    names.REQUEST_ARRIVALS,
    names.SLO_REQUESTS,
    names.SLO_REQUESTS_MET,
)
HISTOGRAMS = (
    names.TIME_TO_FIRST_TOKEN,
    names.INTER_TOKEN_LATENCY,
    names.REQUEST_TIME_PER_OUTPUT_TOKEN,
    names.REQUEST_PROMPT_TOKENS,
    names.REQUEST_GENERATION_TOKENS,
)

# The families the loop reads, as each line of theirs starts. A server exposes many more
# (vLLM's whole set, process and Python metrics): the loop parses only these lines, as
# parsing was 42% of the operator's CPU at 300 services; the cut takes 40% off a parse.
_FAMILIES = (
    *(name.removesuffix("_total") for name in (*GAUGES, *COUNTERS, *HISTOGRAMS)),
    *(name.removesuffix("_total") for name in names.STEP_COUNTERS),
    names.LORA_REQUESTS_INFO,
    names.KV_CACHE_INFO,
)
_WANTED_LINES = _FAMILIES + tuple(f"# TYPE {f}" for f in _FAMILIES)


def wanted_lines(text: str) -> str:
    """The exposition's lines of the families the loop reads (their TYPE lines too: the
    parser groups a histogram's series by them)."""
    return "\n".join(line for line in text.split("\n") if line.startswith(_WANTED_LINES))
