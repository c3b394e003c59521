"""What the loop reads of a replica's /metrics: the families, and a cut of the exposition
to their lines before it is parsed."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

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
    names.DECODE_GRAPHS_INFO,
)
_WANTED_LINES = _FAMILIES + tuple(f"# TYPE {f}" for f in _FAMILIES)


def wanted_lines(text: str) -> str:
    """The exposition's lines of the families the loop reads (their TYPE lines too: the
    parser groups a histogram's series by them)."""
    return "\n".join(line for line in text.split("\n") if line.startswith(_WANTED_LINES))


# --------------------------------------------------------------------------- a fast parse

# The plain lines a server writes: `name{label="value",...} value` or `name value`, label
# values without escapes, no timestamp, no exemplar. parse_families reads those itself,
# as prometheus_client's parser would, at a tenth of its cost (it was 90% of a loop turn's
# CPU at 1,000 services); any other line sends the whole text to that parser.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z][a-zA-Z0-9_]*="[^"\\\n]*"'
# One pass over the text: each line a TYPE line, a plain sample, or anything else (group 6).
_LINE = re.compile(
    rf"^(?:# TYPE ({_NAME}) (\S+)|({_NAME})(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})? (\S+)|(.*))$",
    re.MULTILINE,
)
_LABELS = re.compile(r'([a-zA-Z][a-zA-Z0-9_]*)="([^"\\\n]*)"')
_LABEL_CACHE_SIZE = 4096  # label sets repeat scrape after scrape: each is read once
_ALLOWED = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}


class Family(NamedTuple):
    """A metric family as prometheus_client.parser yields it: its name and samples."""

    name: str
    samples: list[Sample]


def parse_families(text: str) -> Iterable[Any]:
    """The families of ``text`` (wanted_lines' cut), as prometheus_client's
    ``text_string_to_metric_families`` gives them: the fast read where every line is plain,
    that parser otherwise (so its errors and its reading of the rest stay the same)."""
    families = _plain_families(text)
    return text_string_to_metric_families(text) if families is None else families


def _plain_families(text: str) -> list[Family] | None:
    """The families, or None if a line is not plain. It follows the text parser's state
    machine: a TYPE line opens a family, a sample its type does not allow closes it and
    stands alone as an untyped one, and a counter's name loses its _total (or its samples
    gain one)."""
    out: list[Family] = []
    name, typ, samples = "", "untyped", []
    allowed: tuple[str, ...] = ()
    for type_name, new_type, sample_name, labels_text, value_text, other in _LINE.findall(text):
        if type_name:
            if type_name != name:
                if name:
                    out.append(_family(name, typ, samples))
                name, samples = type_name, []
            typ = new_type
            allowed = tuple(name + s for s in _ALLOWED.get(typ, ("",)))
            continue
        if not sample_name:
            if other.strip():
                return None
            continue  # a blank line
        value = _value(value_text)
        labels = _labels(labels_text)
        if value is None or labels is None:
            return None
        sample = Sample(sample_name, labels, value)
        if sample_name in allowed:
            samples.append(sample)
            continue
        if name:
            out.append(_family(name, typ, samples))
        name, typ, samples, allowed = "", "untyped", [], ()
        out.append(_family(sample_name, "untyped", [sample]))
    if name:
        out.append(_family(name, typ, samples))
    return out


_label_cache: dict[str, dict[str, str]] = {}


def _labels(text: str) -> dict[str, str] | None:
    """A sample's labels (shared between samples with the same: nothing changes them);
    None for a label named twice, which the parser refuses."""
    labels = _label_cache.get(text)
    if labels is None:
        labels = dict(_LABELS.findall(text)) if text else {}
        if text and len(labels) != text.count('="'):
            return None
        if len(_label_cache) >= _LABEL_CACHE_SIZE:
            _label_cache.clear()
        _label_cache[text] = labels
    return labels


def _value(text: str) -> float | None:
    """As the parser reads a value (an int where it is one); None where it refuses it."""
    if text.isdecimal():
        return int(text)
    if "_" in text:
        return None  # float() would read "1_000"; the parser refuses it
    try:
        return float(text)  # "-5" too: the loop adds every value to a float
    except ValueError:
        return None


def _family(name: str, typ: str, samples: list[Sample]) -> Family:
    if typ == "counter":
        if name.endswith("_total"):
            name = name[: -len("_total")]
        else:
            samples = [s._replace(name=s.name + "_total") for s in samples]
    return Family(name, samples)
