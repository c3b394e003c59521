"""observe.py and scrape.py: parsing the server's real /metrics text, windows, counter resets, histogram
P99 from bucket deltas, and scraping that skips and counts what does not answer."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web

from batchpilot import names
from batchpilot.operator.loop.observe import (
    MalformedMetrics,
    Observer,
    bucket_increase,
    histogram_quantile,
    increase,
    parse_metrics,
)
from batchpilot.operator.loop.scrape import Scrape, UrlMetricsSource, ready_pod_urls
from batchpilot.server.api import metrics as server_metrics
from benchmarks.loopsim import metrics as sim
from tests.support.loop import FakeServer


def test_parse_reads_gauges_counters_histograms_and_kv_dtype():
    server = FakeServer()
    server.stats["num_preemptions"] = 7
    server.metrics.itl.observe(0.03)
    sample = parse_metrics(server.text(), now=1.0)
    assert sample.gauges[names.NUM_REQUESTS_RUNNING] == 3
    assert sample.gauges[names.NUM_REQUESTS_WAITING] == 5
    assert sample.gauges[names.MAX_NUM_SEQS_METRIC] == 8
    assert sample.counters[names.NUM_PREEMPTIONS] == 7
    assert sample.kv_cache_dtype == "fp8"
    itl = dict(sample.buckets[names.INTER_TOKEN_LATENCY])
    assert itl[0.025] == 0 and itl[0.05] == 1 and itl[math.inf] == 1


@pytest.mark.parametrize("text", ["<html>not metrics</html>", "foo{ 1", "up 1\n"])
def test_parse_rejects_what_is_not_a_batchpilot_server(text):
    with pytest.raises(MalformedMetrics):
        parse_metrics(text, now=0.0)


def test_counter_increase_survives_a_restart():
    assert increase([10, 15, 20]) == 10
    assert increase([10, 15, 3, 5]) == 5 + 3 + 2  # restarted: counted from zero again


def test_histogram_reset_is_judged_on_the_whole_histogram():
    before = ((0.1, 10.0), (math.inf, 12.0))
    after_reset = ((0.1, 11.0), (math.inf, 11.0))  # +Inf dropped: a new process
    assert bucket_increase([before, after_reset]) == ((0.1, 11.0), (math.inf, 11.0))


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = ((0.1, 50.0), (0.2, 100.0), (math.inf, 100.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.198)
    assert histogram_quantile(0.99, ((0.1, 0.0), (math.inf, 5.0))) == 0.1  # +Inf: last bound
    assert histogram_quantile(0.99, ((0.1, 0.0), (math.inf, 0.0))) is None


def test_window_p99_counts_only_observations_inside_the_window():
    server, observer = FakeServer(), Observer(window_seconds=60)
    for _ in range(1000):
        server.metrics.itl.observe(2.0)  # slow, but before the window starts
    observer.record("ns/a", [Scrape("http://r0", text=server.text())], now=0.0)
    for _ in range(100):
        server.metrics.itl.observe(0.03)
    observer.record("ns/a", [Scrape("http://r0", text=server.text())], now=30.0)
    window = observer.window("ns/a")
    assert 0.025 < window.itl_p99 <= 0.05


def test_window_rates_means_and_pruning():
    server, observer = FakeServer(), Observer(window_seconds=60)
    for t in range(0, 121, 10):
        server.stats["num_preemptions"] = t // 10  # one every 10 s
        server.stats["num_waiting"] = 4 if t >= 70 else 0
        observer.record("ns/a", [Scrape("http://r0", text=server.text())], now=float(t))
    window = observer.window("ns/a")
    assert window.span_seconds == 60  # older samples pruned
    assert window.preemptions_per_minute == pytest.approx(6.0)
    assert window.waiting == pytest.approx(4 * 6 / 7)  # 60..120: the 60 s sample had 0
    assert window.waiting_now == 4
    assert window.max_num_seqs == {"http://r0": 8}
    assert window.kv_cache_dtype_in_force == "fp8"


def test_service_window_sums_replicas_and_keeps_the_fullest_kv():
    a, b, observer = FakeServer(), FakeServer(), Observer()
    b.stats.update(num_waiting=1, kv_cache_usage=0.9)
    for t in (0.0, 10.0):
        observer.record(
            "ns/s", [Scrape("http://a", text=a.text()), Scrape("http://b", text=b.text())], now=t
        )
    window = observer.window("ns/s")
    assert window.replicas == 2
    assert window.waiting == 6 and window.running == 6
    assert window.kv_cache_usage == 0.9
    assert window.per_replica(window.waiting) == 3


def test_since_drops_samples_from_before_a_change():
    server, observer = FakeServer(), Observer()
    server.stats["num_preemptions"] = 100
    observer.record("ns/a", [Scrape("http://r0", text=server.text())], now=0.0)
    server.stats["num_preemptions"] = 200
    observer.record("ns/a", [Scrape("http://r0", text=server.text())], now=10.0)
    observer.record("ns/a", [Scrape("http://r0", text=server.text())], now=20.0)
    assert observer.window("ns/a").preemptions_per_minute > 0
    assert observer.window("ns/a", since=5.0).preemptions_per_minute == 0


def test_failures_are_skipped_and_counted():
    observer = Observer()
    result = observer.record(
        "ns/a",
        [
            Scrape("http://ok", text=FakeServer().text()),
            Scrape("http://down", error="ClientConnectorError"),
            Scrape("http://html", text="<html></html>"),
        ],
        now=0.0,
    )
    assert result.scraped == 1
    assert set(result.failures) == {"http://down", "http://html"}
    assert observer.scrape_failures_total == 2
    assert observer.window("ns/a").replicas == 1


def test_the_simulator_quantizes_latency_like_the_server():
    assert sim.ITL_BUCKETS == server_metrics.ITL_BUCKETS
    assert sim.TTFT_BUCKETS == server_metrics.TTFT_BUCKETS
    assert sim.TPOT_BUCKETS == server_metrics.TPOT_BUCKETS == names.TPOT_BUCKETS
    assert sim.REQUEST_TOKEN_BUCKETS == server_metrics.REQUEST_TOKEN_BUCKETS
    # The simulator's step cells label batches as the server does.
    assert server_metrics.BATCH_BUCKETS == names.BATCH_BUCKETS


def test_url_source_scrapes_real_endpoints_concurrently_and_reports_failures(unused_port):
    server = FakeServer()

    async def metrics(request):
        return web.Response(text=server.text())

    async def broken(request):
        return web.Response(status=500, text="oops")

    async def main():
        app = web.Application()
        app.router.add_get("/ok/metrics", metrics)
        app.router.add_get("/broken/metrics", broken)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            base = f"http://127.0.0.1:{port}"
            source = UrlMetricsSource(
                [f"{base}/ok", f"{base}/broken", f"http://127.0.0.1:{unused_port}"]
            )
            return await source.scrape("ns", "svc")
        finally:
            await runner.cleanup()

    scrapes = asyncio.run(main())
    assert scrapes[0].text and names.NUM_REQUESTS_RUNNING in scrapes[0].text
    assert scrapes[1].error == "HTTP 500"
    assert scrapes[2].text is None and scrapes[2].error


@pytest.fixture
def unused_port() -> int:
    from batchpilot.server.bench.server_process import free_port

    return free_port()


def test_ready_pods_with_an_ip_are_scraped_on_the_server_port():
    from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

    def pod(name, ip, ready="True", deleting=False):
        return V1Pod(
            metadata=V1ObjectMeta(
                name=name, deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None
            ),
            status=V1PodStatus(pod_ip=ip, conditions=[V1PodCondition(type="Ready", status=ready)]),
        )

    pods = [
        pod("a", "10.0.0.2"),
        pod("b", "10.0.0.3", ready="False"),
        pod("c", None),
        pod("d", "10.0.0.4", deleting=True),
        pod("e", "fd00::5"),
    ]
    assert ready_pod_urls(pods, 8000) == ["http://10.0.0.2:8000", "http://[fd00::5]:8000"]


def test_forget_drops_a_service():
    observer = Observer()
    observer.record("ns/a", [Scrape("http://r0", text=FakeServer().text())], now=0.0)
    observer.forget("ns/a")
    assert observer.window("ns/a") is None


def test_the_cut_keeps_whole_every_family_the_loop_reads_and_drops_the_rest():
    from prometheus_client.parser import text_string_to_metric_families

    from batchpilot.operator.loop.exposition import COUNTERS, GAUGES, HISTOGRAMS, wanted_lines

    server = FakeServer()
    server.stats["num_preemptions"] = 7
    server.metrics.itl.observe(0.03)
    server.metrics.ttft.observe(0.2)
    text = server.text()
    read = {
        n.removesuffix("_total") for n in (*GAUGES, *COUNTERS, *HISTOGRAMS, *names.STEP_COUNTERS)
    }
    read |= {names.LORA_REQUESTS_INFO, names.KV_CACHE_INFO}
    full = {f.name: f.samples for f in text_string_to_metric_families(text)}
    cut = {f.name: f.samples for f in text_string_to_metric_families(wanted_lines(text))}
    assert {n: s for n, s in cut.items() if n in read} == {
        n: s for n, s in full.items() if n in read
    }
    # Besides those, only their own series (a histogram's _created) pass the cut.
    assert all(n.startswith(tuple(read)) for n in cut)
    assert set(full) - read, "the server exposes families the loop does not read"
    assert len(wanted_lines(text)) < len(text)
