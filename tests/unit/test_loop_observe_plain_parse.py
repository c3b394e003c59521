"""exposition.parse_families: the plain lines a server writes are read directly, exactly as
prometheus_client's text parser reads them (same families, names, labels and values);
any other line hands the whole text to that parser, so its errors stay the same."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot.operator.loop import exposition
from batchpilot.operator.loop.exposition import _plain_families, parse_families, wanted_lines
from batchpilot.operator.loop.observe import MalformedMetrics, parse_metrics
from benchmarks.operator_scale.fake_replicas import FakeReplica
from tests.support.loop import FakeServer


def read(families) -> list:
    return [(f.name, [(s.name, s.labels, s.value) for s in f.samples]) for f in families]


def slow(text: str) -> list:
    return read(text_string_to_metric_families(text))


def server_texts() -> list[str]:
    idle = FakeServer()
    busy = FakeServer()
    busy.stats.update(num_preemptions=7, max_lora=2, running_lora_adapters=("a", "b"),
                      waiting_lora_adapters=("c",), oldest_waiting_arrival=1.0)  # fmt: skip
    busy.metrics.itl.observe(0.03)
    busy.metrics.ttft.observe(0.2)
    replica = FakeReplica(seed=3)
    replica.advance(1000.0, 15.0)
    return [idle.text(), busy.text(), replica.render().decode()]


@pytest.mark.parametrize("text", server_texts(), ids=["server", "server-lora", "bench-fake"])
def test_a_servers_exposition_is_read_plainly_and_as_the_parser_reads_it(text):
    cut = wanted_lines(text)
    plain = _plain_families(cut)
    assert plain is not None, "a server's own lines must not need the slow parser"
    assert read(plain) == slow(cut)
    assert read(parse_families(text)) == slow(text)  # the uncut text: HELP lines go slow


ODD = {
    "counter without _total": "# TYPE c counter\nc 3\n",
    "counter with _total": '# TYPE c_total counter\nc_total{a="1"} 3\n',
    "a sample outside its TYPE": "# TYPE g gauge\ng 1\nother 2\ng 3\n",
    "untyped alone": 'x 1\ny{a="b"} 2.5\n',
    "histogram and _created": (
        "# TYPE h histogram\n"
        'h_bucket{le="1.0"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3\nh_count 2\nh_created 5\n'
    ),
    "the same TYPE twice": "# TYPE g gauge\ng 1\n# TYPE g gauge\ng 2\n",
    "special values": "a +Inf\nb -Inf\nc NaN\nd 1e3\ne -5\nf 0x10\n",
    "values the parser refuses": "a 1_000\n",
    "trailing comma, empty braces": 'a{b="1",} 1\nc{} 2\n',
    "quoted commas and braces": 'a{b="x,y}{=",c=""} 1\n',
    "an escaped label value": 'a{b="x\\"y"} 1\n',
    "a timestamp": "a 1 1700000000000\n",
    "an exemplar": 'a_total 1 # {t="1"} 1\n',
    "a label named twice": 'a{b="1",b="2"} 1\n',
    "spaces and tabs": 'a { b = "1" } 1\nc\t2\n',
    "a HELP line": "# HELP a doc\n# TYPE a gauge\na 1\n",
    "a comment": "# hello there\na 1\n",
    "summary": '# TYPE s summary\ns{quantile="0.5"} 1\ns_sum 2\ns_count 3\n',
    "a reserved label": 'a{__x="1"} 1\n',
    "a bad name": "1a 2\n",
    "no value": "a\n",
    "unicode digits": "a \u0661\u0662\n",
    "a label value over two lines": 'a{b="x\ny"} 1\n',
    "a carriage return": "a 1\r\nb 2\n",
    "a blank line and spaces": "\na 1\n   \nb 2 \n",
    "a TYPE line with more": "# TYPE a gauge extra\na 1\n",
}


@pytest.mark.parametrize("text", ODD.values(), ids=ODD.keys())
def test_every_text_reads_as_the_parser_reads_it_or_fails_as_it_does(text):
    try:
        expected = slow(text)
    except Exception as e:  # the parser refuses it: so must the fast read
        with pytest.raises(type(e)):
            read(parse_families(text))
        assert _plain_families(text) is None
        return
    assert read(parse_families(text)) == expected
    plain = _plain_families(text)
    assert plain is None or read(plain) == expected


def test_a_plain_exposition_never_reaches_the_slow_parser(monkeypatch):
    def refuse(text):
        raise AssertionError("the slow parser ran")

    monkeypatch.setattr(exposition, "text_string_to_metric_families", refuse)
    for text in server_texts():
        assert parse_metrics(text, 0.0).gauges


def test_an_odd_line_goes_to_the_parser_and_its_errors_stay_malformed_metrics():
    text = FakeServer().text()
    with pytest.raises(MalformedMetrics):
        parse_metrics(text.replace("vllm:num_requests_running{", "vllm:num_requests_running{{"),
                      0.0)  # fmt: skip
    # An escaped label value: read by the slow parser, with the same result.
    escaped = text + 'vllm:num_requests_waiting{model_name="a\\"b"} 4.0\n'
    assert _plain_families(wanted_lines(escaped)) is None
    assert parse_metrics(escaped, 0.0).gauges == parse_metrics(text, 0.0).gauges | {
        "vllm:num_requests_waiting": parse_metrics(text, 0.0).gauges["vllm:num_requests_waiting"]
        + 4.0
    }
