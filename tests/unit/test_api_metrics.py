"""/metrics rendering from EngineStats, histogram observation from step results, and the
periodic stats line."""

import dataclasses
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot import names
from batchpilot.server.api.metrics import ServerMetrics, SloTargets, slo_targets
from batchpilot.server.api.stats_log import is_idle, stats_line
from batchpilot.server.engine.core import Turn
from batchpilot.server.engine.sequence import Timings
from batchpilot.server.engine.stats import EngineStats
from batchpilot.server.output.outputs import CompletionOutput, RequestOutput

STATS = EngineStats(
    num_running=3, num_waiting=2, num_swapped=1, num_kv_blocks=100, num_free_kv_blocks=75,
    kv_cache_usage=0.25, num_cpu_blocks=10, num_free_cpu_blocks=5, cpu_cache_usage=0.5,
    num_preemptions=4, num_swaps_out=5, num_swaps_in=6, num_steps=10, prompt_tokens_total=70,
    generation_tokens_total=80, prefix_cache_queries=64, prefix_cache_hits=48, last_step_num_tokens=9, last_step_batch_size=3,
    max_num_seqs=32, max_num_batched_tokens=512, kv_cache_dtype="fp8", block_size=16,
    max_concurrency=1.5, max_lora=0, running_lora_adapters=[], waiting_lora_adapters=[],
)  # fmt: skip


def samples(metrics: ServerMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(found: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": "m", **labels}.items())))
    return found[key]


def test_gauges_and_counters_read_stats_at_scrape_time():
    stats = dataclasses.replace(STATS)
    metrics = ServerMetrics("m", lambda: stats)
    found = samples(metrics)
    assert value(found, names.NUM_REQUESTS_RUNNING) == 3
    assert value(found, names.NUM_REQUESTS_WAITING) == 2
    assert value(found, names.NUM_REQUESTS_SWAPPED) == 1
    assert value(found, names.KV_CACHE_USAGE) == 0.25
    assert value(found, names.CPU_CACHE_USAGE) == 0.5
    assert value(found, names.NUM_PREEMPTIONS) == 4
    assert value(found, names.PROMPT_TOKENS) == 70
    assert value(found, names.GENERATION_TOKENS) == 80
    assert value(found, names.PREFIX_CACHE_QUERIES) == 64
    assert value(found, names.PREFIX_CACHE_HITS) == 48
    assert value(found, names.SWAPS_OUT) == 5 and value(found, names.SWAPS_IN) == 6
    assert value(found, names.MAX_NUM_SEQS_METRIC) == 32
    assert value(found, names.MAX_NUM_BATCHED_TOKENS_METRIC) == 512
    info = dict(dtype="fp8", block_size="16", num_blocks="100")
    assert value(found, names.KV_CACHE_INFO, **info) == 1
    # vLLM's family, as GIE's endpoint picker reads it (block_size, num_gpu_blocks).
    config = {"block_size": "16", "cache_dtype": "fp8", "num_gpu_blocks": "100"}
    assert value(found, names.CACHE_CONFIG_INFO, **config) == 1
    stats.max_num_seqs, stats.max_num_batched_tokens = 8, 256
    found = samples(metrics)
    assert value(found, names.MAX_NUM_SEQS_METRIC) == 8
    assert value(found, names.MAX_NUM_BATCHED_TOKENS_METRIC) == 256


def test_every_listed_name_is_exposed():
    exposed = {name for name, _ in samples(ServerMetrics("m", lambda: STATS))}
    for name in names.ALL_METRICS:
        assert any(e == name or e.startswith(name + "_") for e in exposed), name


def test_lora_requests_info_only_with_lora_and_only_its_latest_labels():
    assert not any(
        name == names.LORA_REQUESTS_INFO for name, _ in samples(ServerMetrics("m", lambda: STATS))
    )
    stats = dataclasses.replace(STATS, max_lora=2, running_lora_adapters=["sql", "chat"],
                                waiting_lora_adapters=[])  # fmt: skip
    metrics = ServerMetrics("m", lambda: stats)
    before = time.time()
    found = {labels: v for (name, labels), v in samples(metrics).items()
             if name == names.LORA_REQUESTS_INFO}  # fmt: skip
    # vLLM's labels, names sorted and comma-joined, no model_name; the value is the time.
    labels = (("max_lora", "2"), ("running_lora_adapters", "chat,sql"),
              ("waiting_lora_adapters", ""))  # fmt: skip
    assert list(found) == [labels]
    assert before - 1 <= found[labels] <= time.time() + 1
    stats.running_lora_adapters, stats.waiting_lora_adapters = [], ["sql"]
    found = [
        labels for (name, labels), _ in samples(metrics).items() if name == names.LORA_REQUESTS_INFO
    ]
    assert found == [(("max_lora", "2"), ("running_lora_adapters", ""),
                      ("waiting_lora_adapters", "sql"))]  # fmt: skip


def output(rid: str, tokens: list[int], new: int, finished: bool, timing: Timings):
    completion = CompletionOutput(0, "", tokens, "x", tokens[-new:] if new else [], None)
    return RequestOutput(rid, "p", [1, 2], [completion], finished, timing)


def test_histograms_from_steps():
    metrics = ServerMetrics("m", lambda: STATS)
    timing = Timings(arrival_time=100.0)
    timing.first_scheduled_time, timing.first_token_time = 100.5, 101.0
    metrics.observe_step(Turn([output("a", [7], 1, False, timing)], STATS, True, 101.0))
    metrics.observe_step(Turn([output("a", [7, 8], 1, False, timing)], STATS, True, 101.2))
    timing.finished_time = 101.6
    metrics.observe_step(Turn([output("a", [7, 8, 9, 10], 2, True, timing)], STATS, True,
                                    101.6))  # fmt: skip
    metrics.observe_step(Turn([], STATS, False, 102.0))  # no step ran: nothing observed
    found = samples(metrics)
    assert value(found, names.TIME_TO_FIRST_TOKEN + "_count") == 1
    assert value(found, names.TIME_TO_FIRST_TOKEN + "_sum") == 1.0
    assert value(found, names.INTER_TOKEN_LATENCY + "_count") == 3
    assert value(found, names.INTER_TOKEN_LATENCY + "_sum") == pytest.approx(0.6)
    assert value(found, names.E2E_REQUEST_LATENCY + "_sum") == pytest.approx(1.6)
    assert value(found, names.REQUEST_QUEUE_TIME + "_sum") == pytest.approx(0.5)
    assert value(found, names.ITERATION_TOKENS + "_count") == 3
    assert value(found, names.ITERATION_TOKENS + "_sum") == 27
    assert value(found, names.BATCH_SIZE + "_sum") == 9
    assert value(found, names.TIME_TO_FIRST_TOKEN + "_bucket", le="0.001") == 0


def finish(metrics: ServerMetrics, rid: str, ttft: float, tpot: float, tokens: int) -> None:
    timing = Timings(arrival_time=100.0)
    timing.first_scheduled_time = timing.first_token_time = 100.0 + ttft
    timing.finished_time = timing.first_token_time + tpot * (tokens - 1)
    ids = list(range(tokens))
    metrics.observe_step(Turn([output(rid, ids, tokens, True, timing)], STATS, True, 200.0))


def test_finished_requests_are_counted_against_both_slo_targets_exactly():
    # A 30 ms TPOT target sits inside vLLM's 25-50 ms bucket, where the histogram can only
    # interpolate; the counters judge each request itself.
    metrics = ServerMetrics("m", lambda: STATS, SloTargets(ttft_seconds=1.0, tpot_seconds=0.03))
    finish(metrics, "ok", ttft=0.5, tpot=0.028, tokens=11)
    finish(metrics, "slow-tokens", ttft=0.5, tpot=0.032, tokens=11)
    finish(metrics, "late-first", ttft=1.5, tpot=0.01, tokens=11)
    finish(metrics, "one-token", ttft=0.9, tpot=0.0, tokens=1)  # no TPOT to miss
    found = samples(metrics)
    assert value(found, names.SLO_REQUESTS) == 4
    assert value(found, names.SLO_REQUESTS_MET) == 2
    # Without targets the server exposes neither family.
    plain = {name for name, _ in samples(ServerMetrics("m", lambda: STATS))}
    assert names.SLO_REQUESTS not in plain and names.SLO_REQUESTS_MET not in plain


def test_one_slo_target_alone_leaves_the_other_unbounded():
    args = dataclasses.make_dataclass(
        "A", ["slo_time_to_first_token_seconds", "slo_inter_token_latency_seconds"]
    )
    assert slo_targets(args(None, None)) is None
    only_ttft = slo_targets(args(2.0, None))
    assert only_ttft.met(1.0, 99.0) and not only_ttft.met(2.5, 0.0) and not only_ttft.met(None, 0)


def test_stats_line_rates_and_idle_detection():
    before = dataclasses.replace(STATS, prompt_tokens_total=0, generation_tokens_total=20,
                                 num_preemptions=1)  # fmt: skip
    line = stats_line(before, STATS, 10.0)
    assert "Avg prompt throughput: 7.0 tokens/s" in line
    assert "Avg generation throughput: 6.0 tokens/s" in line
    assert "Running: 3 reqs, Swapped: 1 reqs, Pending: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line and "Preemptions: 3" in line
    idle = dataclasses.replace(STATS, num_running=0, num_waiting=0, num_swapped=0)
    assert is_idle(idle, idle)
    assert not is_idle(idle, dataclasses.replace(idle, num_steps=11))
    assert not is_idle(STATS, STATS)


def test_the_servers_cli_takes_the_slo_flags_the_operator_renders_and_bounds_them():
    import argparse

    from batchpilot.operator.children.pod import slo_args
    from batchpilot.operator.crd.spec import parse_spec
    from batchpilot.server.api.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    slo = {"timeToFirstTokenSeconds": 1.5, "interTokenLatencySeconds": 0.03}
    tuned = parse_spec({"slo": slo, "tuning": {"enabled": True}})
    assert slo_targets(parser.parse_args(slo_args(tuned))) == SloTargets(1.5, 0.03)
    assert slo_args(parse_spec({"slo": slo})) == []  # untuned templates stay as they were
    for bad in ("0", "-1", "nan", "3601"):
        with pytest.raises(SystemExit):
            parser.parse_args([f"{names.SLO_TTFT_FLAG}={bad}"])
