"""observe.py's inputs for the loop's models (loop v3): per-request TPOT, prompt and output
lengths, arrivals, the oldest waiting age and the step-cost cells, windowed per replica
(counter resets handled) and merged over replicas; and the simulator's /metrics, which
must read exactly as the server's."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot import names
from batchpilot.operator.loop.observe import Observer, StepCell, parse_metrics, replica_window
from batchpilot.operator.loop.observe_steps import NO_PADDING, Padding
from batchpilot.operator.loop.scrape import Scrape
from batchpilot.server.api import metrics as server_metrics
from benchmarks.loopsim import CPU, ReplicaConfig, ReplicaSim, Request
from benchmarks.loopsim import metrics as sim_metrics

V3_FAMILIES = {
    names.REQUEST_TIME_PER_OUTPUT_TOKEN,
    names.REQUEST_PROMPT_TOKENS,
    names.REQUEST_GENERATION_TOKENS,
    names.REQUEST_ARRIVALS.removesuffix("_total"),
    names.OLDEST_WAITING_SECONDS,
    *(name.removesuffix("_total") for name in names.STEP_COUNTERS),
}


def histogram(name: str, counts: dict[str, float], total: float) -> list[str]:
    """Cumulative bucket lines; counts: le -> cumulative count, "+Inf" last."""
    lines = [f'{name}_bucket{{model_name="m",le="{le}"}} {c}' for le, c in counts.items()]
    return [f"# TYPE {name} histogram", *lines, f'{name}_count{{model_name="m"}} {counts["+Inf"]}',
            f'{name}_sum{{model_name="m"}} {total}']  # fmt: skip


def exposition(
    arrivals: float,
    finished: float,
    steps: dict[tuple[str, str], tuple[float, ...]],
    oldest: float = 0.0,
    num_blocks: int = 100,
) -> str:
    """A server's text: ``finished`` requests of 10 prompt and 4 output tokens at 0.05 s
    per output token; ``steps``: (batch, phase) -> the six step counters."""
    lines = [
        'vllm:num_requests_running{model_name="m"} 1',
        f'batchpilot:oldest_waiting_seconds{{model_name="m"}} {oldest}',
        f'batchpilot:request_arrivals_total{{model_name="m"}} {arrivals}',
        f'batchpilot:kv_cache_info{{model_name="m",dtype="auto",block_size="16",'
        f'num_blocks="{num_blocks}"}} 1',
        *histogram(names.REQUEST_TIME_PER_OUTPUT_TOKEN,
                   {"0.025": 0, "0.05": finished, "+Inf": finished}, 0.05 * finished),
        *histogram(names.REQUEST_PROMPT_TOKENS, {"5": 0, "10": finished, "+Inf": finished},
                   10 * finished),
        *histogram(names.REQUEST_GENERATION_TOKENS, {"2": 0, "5": finished, "+Inf": finished},
                   4 * finished),
    ]  # fmt: skip
    for (batch, phase), values in steps.items():
        for name, value in zip(names.STEP_COUNTERS, values, strict=True):
            lines.append(f'{name}{{model_name="m",batch="{batch}",phase="{phase}"}} {value}')
    return "\n".join(lines) + "\n"


def test_parse_reads_the_new_families():
    text = exposition(7, 3, {("8", "decode"): (2, 0.5, 16, 16, 0, 900)}, oldest=1.5)
    sample = parse_metrics(text, now=0.0)
    assert sample.counters[names.REQUEST_ARRIVALS] == 7
    assert sample.gauges[names.OLDEST_WAITING_SECONDS] == 1.5
    assert sample.sums[names.REQUEST_PROMPT_TOKENS] == 30
    assert dict(sample.buckets[names.REQUEST_GENERATION_TOKENS])[math.inf] == 3
    assert sample.steps == {(8.0, "decode"): [2, 0.5, 16, 16, 0, 900]}
    assert (sample.kv_num_blocks, sample.kv_block_size) == (100, 16)


def test_replica_window_takes_increases_and_survives_a_reset():
    decode, mixed = ("8", "decode"), ("+Inf", "mixed")
    scrapes = [
        (0.0, exposition(10, 2, {decode: (5, 1.0, 40, 40, 0, 4000)}, oldest=3.0)),
        (10.0, exposition(30, 6, {decode: (9, 1.8, 72, 72, 0, 7000),
                                  mixed: (1, 0.4, 1100, 1000, 500, 80000)}, oldest=0.0)),
        # The replica restarted: everything counts from zero again.
        (20.0, exposition(5, 1, {decode: (2, 0.5, 14, 14, 0, 900)}, oldest=2.0,
                          num_blocks=120)),
    ]  # fmt: skip
    window = replica_window("http://r", [parse_metrics(text, t) for t, text in scrapes])
    # Increases: 20 then 5 after the reset, over 20 s.
    assert window.arrivals_per_second == pytest.approx(25 / 20)
    assert window.requests_finished == 4 + 1
    assert window.prompt_tokens_sum == 10 * 5 and window.output_tokens_sum == 4 * 5
    assert dict(window.output_tokens_buckets) == {2.0: 0, 5.0: 5, math.inf: 5}
    assert dict(window.prompt_tokens_buckets)[10.0] == 5
    assert dict(window.tpot_buckets) == {0.025: 0, 0.05: 5, math.inf: 5}
    assert window.oldest_waiting_seconds == 2.0  # the latest scrape's
    assert window.steps == (
        StepCell(8.0, "decode", steps=4 + 2, seconds=pytest.approx(0.8 + 0.5),
                 sequences=32 + 14, decode_sequences=32 + 14, prefill_tokens=0,
                 context_tokens=3000 + 900),
        StepCell(math.inf, "mixed", 1, 0.4, 1100, 1000, 500, 80000),
    )  # fmt: skip
    assert window.kv_num_blocks == {"http://r": 120} and window.kv_block_size == 16
    assert window.summary()["tpotP90Seconds"] == pytest.approx(0.025 + 0.9 * 0.025)


def test_service_window_merges_replicas():
    observer = Observer(window_seconds=60)
    a0 = exposition(0, 0, {("4", "decode"): (1, 0.1, 4, 4, 0, 100)}, oldest=1.0)
    a1 = exposition(10, 4, {("4", "decode"): (11, 1.1, 44, 44, 0, 1100)}, oldest=4.0)
    b0 = exposition(0, 0, {}, num_blocks=50)
    b1 = exposition(20, 2, {("4", "decode"): (3, 0.3, 12, 12, 0, 300),
                            ("8", "mixed"): (2, 0.6, 14, 10, 64, 500)}, oldest=9.0,
                    num_blocks=50)  # fmt: skip
    observer.record("ns/s", [Scrape("http://a", text=a0), Scrape("http://b", text=b0)], 0.0)
    observer.record("ns/s", [Scrape("http://a", text=a1), Scrape("http://b", text=b1)], 10.0)
    window = observer.window("ns/s")
    assert window.replicas == 2
    assert window.arrivals_per_second == pytest.approx(1 + 2)
    assert window.requests_finished == 6
    assert window.prompt_tokens_sum == 60 and window.output_tokens_sum == 24
    assert dict(window.tpot_buckets)[math.inf] == 6
    assert window.oldest_waiting_seconds == 9.0  # the longest over replicas
    assert window.steps == (
        StepCell(4.0, "decode", 13, pytest.approx(1.3), 52, 52, 0, 1300),
        StepCell(8.0, "mixed", 2, 0.6, 14, 10, 64, 500),
    )
    assert window.kv_num_blocks == {"http://a": 100, "http://b": 50}
    assert window.kv_block_size == 16


def test_a_server_without_the_new_families_reads_as_before():
    text = 'vllm:num_requests_running{model_name="m"} 2\n'
    window = replica_window("u", [parse_metrics(text, 0.0), parse_metrics(text, 5.0)])
    assert window.steps == () and window.tpot_buckets == ()
    assert window.requests_finished == 0 and window.arrivals_per_second == 0
    assert window.kv_num_blocks == {} and window.kv_block_size is None
    assert "tpotP90Seconds" not in window.summary()


# --------------------------------------------------------------------------- parity


def families(text: str) -> dict[str, set[str]]:
    """Family name -> its samples' label names (less le)."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = out.setdefault(family.name, set())
        for s in family.samples:
            labels.update(k for k in s.labels if k != "le")
    return out


def server_text(decode_graph_sizes: tuple[int, ...] = ()) -> str:
    """The server's families after one mixed step and one finished request."""
    stats = SimpleNamespace(
        num_running=1, num_waiting=0, num_swapped=0, kv_cache_usage=0.1, cpu_cache_usage=0.0,
        max_num_seqs=8, max_num_batched_tokens=512, num_preemptions=0, prompt_tokens_total=5,
        generation_tokens_total=2, num_swaps_out=0, num_swaps_in=0, num_arrivals=1,
        prefix_cache_queries=0, prefix_cache_hits=0,
        oldest_waiting_arrival=None, kv_cache_dtype="auto", block_size=16, num_kv_blocks=100,
        max_lora=0, decode_graph_sizes=decode_graph_sizes, num_steps=1, last_step_num_tokens=5, last_step_batch_size=1,
        last_step_decode_seqs=0, last_step_prefill_tokens=5, last_step_context_tokens=0,
    )  # fmt: skip
    metrics = server_metrics.ServerMetrics(sim_metrics.MODEL_NAME, lambda: stats)
    metrics.observe_step(SimpleNamespace(stepped=True, stats=stats, step_seconds=0.1,
                                         outputs=[], aborted=[], time=0.0))  # fmt: skip
    metrics.tpot.observe(0.1)
    metrics.prompt_tokens.observe(5)
    metrics.generation_tokens.observe(2)
    return metrics.render()[0].decode()


def run_sim(seconds: float) -> ReplicaSim:
    replica = ReplicaSim("http://sim", ReplicaConfig(max_num_seqs=16,
                         max_num_batched_tokens=512), CPU.model, 0.0)  # fmt: skip
    rng = random.Random(3)
    t = 0.0
    while t < seconds:
        t += rng.expovariate(4.0)
        replica.advance_to(t)
        replica.submit(Request(t, rng.randrange(20, 700), rng.randrange(1, 60)))
    replica.advance_to(seconds)
    return replica


def test_the_simulator_exposes_the_servers_families_labels_and_buckets():
    assert sim_metrics.TPOT_BUCKETS == server_metrics.TPOT_BUCKETS
    assert sim_metrics.REQUEST_TOKEN_BUCKETS == server_metrics.REQUEST_TOKEN_BUCKETS
    server, sim = families(server_text()), families(run_sim(30.0).metrics_text())
    for name in V3_FAMILIES:
        assert name in server and name in sim, name
        assert server[name] == sim[name], name
    step = names.ENGINE_STEPS.removesuffix("_total")
    assert server[step] == {"model_name", "batch", "phase"}
    # The same bucket bounds, as text, in both.
    for name in (names.REQUEST_TIME_PER_OUTPUT_TOKEN, names.REQUEST_PROMPT_TOKENS):
        les = [
            {s.labels["le"] for f in text_string_to_metric_families(text) if f.name == name
             for s in f.samples if "le" in s.labels}
            for text in (server_text(), run_sim(5.0).metrics_text())
        ]  # fmt: skip
        assert les[0] == les[1], name


def test_a_simulated_replica_reads_back_its_own_counts():
    replica = ReplicaSim("http://sim", ReplicaConfig(max_num_seqs=16,
                         max_num_batched_tokens=512), CPU.model, 0.0)  # fmt: skip
    before = parse_metrics(replica.metrics_text(), 0.0)
    rng = random.Random(5)
    t, sent = 0.0, 0
    while t < 60.0:
        t += rng.expovariate(3.0)
        replica.advance_to(t)
        replica.submit(Request(t, rng.randrange(20, 900), rng.randrange(1, 80)))
        sent += 1
    replica.advance_to(60.0)
    window = replica_window("http://sim", [before, parse_metrics(replica.metrics_text(), 60.0)])

    assert sum(c.steps for c in window.steps) == replica.steps > 0
    own = replica.step_cells.cells
    assert sum(c.sequences for c in window.steps) == sum(v[2] for v in own.values())
    assert sum(c.decode_sequences for c in window.steps) == sum(v[3] for v in own.values())
    assert sum(c.seconds for c in window.steps) == pytest.approx(sum(v[1] for v in own.values()))
    assert {c.phase for c in window.steps} == {"decode", "mixed"}
    # Every prompt token prefilled is in some mixed step (recomputes add to it).
    prefill = sum(c.prefill_tokens for c in window.steps)
    assert prefill == replica.counters["prompt"]
    assert all(c.prefill_tokens == 0 for c in window.steps if c.phase == "decode")
    assert window.arrivals_per_second == pytest.approx(sent / 60.0)
    assert window.requests_finished == replica.finished > 0
    assert window.output_tokens_sum == sum(f.output_len for f in replica.done)
    long = [f for f in replica.done if f.output_len >= 2]
    assert dict(window.tpot_buckets)[math.inf] == len(long)
    assert window.kv_num_blocks == {"http://sim": replica.num_blocks}
    assert window.kv_block_size == CPU.model.block_size
    waiting = replica.waiting
    expected = replica.time - waiting[0].req.arrival if waiting else 0.0
    assert window.oldest_waiting_seconds == pytest.approx(expected)


def test_the_graph_sizes_a_server_or_a_plant_pads_to_are_read_with_which_steps_they_pad():
    # A CPU server captures no graphs: no family, nothing padded.
    assert parse_metrics(server_text(), 0.0).padding == NO_PADDING
    # A GPU server once captured: its decode-only steps pad (runner._forward).
    padding = parse_metrics(server_text((1, 2, 4, 8, 16, 32)), 0.0).padding
    assert padding == Padding((1, 2, 4, 8, 16, 32), all_steps=False)
    assert padding.batch(17, 0) == 32 and padding.batch(17, 256) == 17  # a mixed step: not
    assert padding.batch(33, 0) == 33  # past the largest: unpadded, as the server runs it
    assert padding.batch(0, 0) == 0
    # A simulated plant with capture sizes pads every step with decodes, and says so.
    plant = replace(CPU.model, graph_sizes=(1, 2, 4, 8, 16, 32, 64))
    replica = ReplicaSim("http://sim", ReplicaConfig(max_num_seqs=16,
                         max_num_batched_tokens=512), plant, 0.0)  # fmt: skip
    padding = parse_metrics(replica.metrics_text(), 0.0).padding
    assert padding == Padding((1, 2, 4, 8, 16, 32, 64), all_steps=True)
    assert padding.batch(17, 256) == 32
    window = replica_window("http://sim", [parse_metrics(replica.metrics_text(), t)
                                           for t in (0.0, 15.0)])  # fmt: skip
    assert window.padding == padding
    assert Padding.from_status(padding.to_status()) == padding
    # An odd label costs only the padding, not the scrape.
    for odd in ("", "1,x,4", "1,,2", "-1", ",".join(["8"] * 300), "9" * 20):
        assert Padding.of({names.GRAPH_SIZES_LABEL: odd}) == NO_PADDING, odd


def test_an_odd_kv_layout_label_costs_only_that_field():
    text = exposition(1, 1, {}).replace('num_blocks="100"', 'num_blocks="many"')
    sample = parse_metrics(text, 0.0)
    assert sample.kv_num_blocks is None and sample.kv_block_size == 16
    assert sample.kv_cache_dtype == "auto"
