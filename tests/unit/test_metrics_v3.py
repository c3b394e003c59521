"""The server's metrics for the loop's models (loop v3), from real engine steps on the tiny
model: per-request TPOT, prompt and output lengths, arrivals, the oldest waiting request's
age, and the step-cost counters by batch bucket and phase."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot import names
from batchpilot.server.api.metrics import ServerMetrics
from batchpilot.server.engine.core import EngineCore
from batchpilot.server.engine.llm_engine import LLMEngine
from batchpilot.server.sampling.sampling_params import SamplingParams
from tests.support.models import make_tiny_llama

# (prompt tokens, output tokens): one request of a single token (no TPOT), and prompts
# longer than the step budget (chunked, so some steps mix a prefill chunk with decodes).
REQUESTS = [(13, 1), (40, 4), (27, 6), (9, 3)]
BUDGET = 24


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def engine_of(tiny_model: str, **overrides) -> LLMEngine:
    config = dict(model=tiny_model, dtype="float32", max_model_len=128, device="cpu",
                  kv_cache_memory_bytes=8 << 20, swap_space_bytes=1 << 20,
                  max_num_batched_tokens=BUDGET, enable_prefix_caching=False)  # fmt: skip
    return LLMEngine(**{**config, **overrides})


def add(rid: str, prompt_len: int, output_len: int, arrival: float):
    prompt = [100 + 7 * i + len(rid) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    return ([(rid, prompt, params)], arrival, None)


def samples(metrics: ServerMetrics) -> list:
    text = metrics.render()[0].decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(found: list, name: str, **labels) -> float:
    return sum(
        s.value
        for s in found
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def run(core: EngineCore, metrics: ServerMetrics, adds: list) -> list:
    turns = [core.turn(adds, [], [])]
    metrics.observe_step(turns[0])
    while core.has_work():
        turns.append(core.turn([], [], []))
        metrics.observe_step(turns[-1])
    return turns


def test_finished_requests_arrivals_and_step_costs_from_real_steps(tiny_model):
    engine = engine_of(tiny_model)
    metrics = ServerMetrics("m", engine.stats)
    core = EngineCore(engine)
    now = time.monotonic()
    adds = [add(f"r{i}", p, o, now) for i, (p, o) in enumerate(REQUESTS)]
    turns = run(core, metrics, adds)
    found = samples(metrics)

    prompts, outputs = [p for p, _ in REQUESTS], [o for _, o in REQUESTS]
    tpot = names.REQUEST_TIME_PER_OUTPUT_TOKEN
    assert total(found, tpot + "_count") == sum(o >= 2 for o in outputs)
    assert total(found, tpot + "_bucket", le="+Inf") == 3
    assert total(found, tpot + "_sum") > 0
    assert total(found, names.REQUEST_PROMPT_TOKENS + "_count") == len(REQUESTS)
    assert total(found, names.REQUEST_PROMPT_TOKENS + "_sum") == sum(prompts)
    assert total(found, names.REQUEST_GENERATION_TOKENS + "_sum") == sum(outputs)
    assert total(found, names.REQUEST_GENERATION_TOKENS + "_bucket", le="5.0") == 3
    assert total(found, names.REQUEST_ARRIVALS) == len(REQUESTS)
    assert total(found, names.OLDEST_WAITING_SECONDS) == 0  # none waits now

    stepped = [t for t in turns if t.stepped]
    steps = total(found, names.ENGINE_STEPS)
    assert steps == len(stepped) == engine.stats().num_steps
    assert total(found, names.ENGINE_STEP_SEQUENCES) == sum(
        t.stats.last_step_batch_size for t in stepped
    )
    assert total(found, names.ENGINE_STEP_SECONDS) == pytest.approx(
        sum(t.step_seconds for t in stepped)
    )
    # Each request's first token comes from its prefill; every other one from a decode,
    # whose context is the tokens before it: prompt + k for its k-th decode (from 0).
    decodes = sum(o - 1 for o in outputs)
    assert total(found, names.ENGINE_STEP_DECODE_SEQUENCES) == decodes
    assert total(found, names.ENGINE_STEP_PREFILL_TOKENS) == sum(prompts)
    context = sum(p + k for p, o in REQUESTS for k in range(o - 1))
    assert total(found, names.ENGINE_STEP_CONTEXT_TOKENS) == context
    # A step's phase: mixed with prompt tokens, else decode; batches round up to a bucket.
    cells = {(s.labels["batch"], s.labels["phase"]) for s in found
             if s.name == names.ENGINE_STEPS}  # fmt: skip
    assert {phase for _, phase in cells} == {"decode", "mixed"}
    assert {batch for batch, _ in cells} <= {"1", "2", "4"}
    assert all(s.labels["model_name"] == "m" for s in found if s.name == names.ENGINE_STEPS)
    mixed_prefill = total(found, names.ENGINE_STEP_PREFILL_TOKENS, phase="mixed")
    assert mixed_prefill == sum(prompts)
    assert total(found, names.ENGINE_STEP_PREFILL_TOKENS, phase="decode") == 0


def test_steps_are_labelled_by_their_batch_bucket_and_counted_once(tiny_model):
    engine = engine_of(tiny_model, max_num_batched_tokens=256)
    metrics = ServerMetrics("m", engine.stats)
    core = EngineCore(engine)
    now = time.monotonic()
    turns = run(core, metrics, [add(f"q{i}", 5, 3, now) for i in range(3)])
    # The same Turn seen twice (no new step) counts once.
    metrics.observe_step(turns[-1])
    found = samples(metrics)
    # One prefill step of the three prompts, then two decode steps of three.
    assert total(found, names.ENGINE_STEPS, batch="4", phase="mixed") == 1
    assert total(found, names.ENGINE_STEPS, batch="4", phase="decode") == 2
    assert total(found, names.ENGINE_STEP_SEQUENCES, batch="4", phase="decode") == 6
    assert total(found, names.ENGINE_STEPS) == 3
    assert names.step_batch_label(1) == "1" and names.step_batch_label(3) == "4"
    assert names.step_batch_label(1024) == "1024" and names.step_batch_label(1025) == "+Inf"


def test_oldest_waiting_is_the_age_of_the_head_of_the_queue_at_scrape_time(tiny_model):
    engine = engine_of(tiny_model, max_num_seqs=1)
    metrics = ServerMetrics("m", engine.stats)
    core = EngineCore(engine)
    now = time.monotonic()
    first = core.turn([add("a", 5, 4, now - 10.0), add("b", 5, 2, now - 7.0)], [], [])
    metrics.observe_step(first)
    # "a" runs (max_num_seqs 1); "b" has waited since 7 s ago.
    assert 7.0 <= total(samples(metrics), names.OLDEST_WAITING_SECONDS) < 60.0
    assert total(samples(metrics), names.REQUEST_ARRIVALS) == 2
    while core.has_work():
        metrics.observe_step(core.turn([], [], []))
    assert total(samples(metrics), names.OLDEST_WAITING_SECONDS) == 0.0


def test_the_step_counters_help_follows_the_names_order():
    from batchpilot.server.api.metrics import STEP_COUNTER_HELP

    assert [name for name, _ in STEP_COUNTER_HELP] == list(names.STEP_COUNTERS)
