"""Adapters beyond the slots, as in vLLM: more registered than --max-cpu-loras hold in host
memory all serve, each request's output what it is served alone; the host tier evicts the
least recently used adapter, never one a running request (or an earlier waiting one) uses;
a request whose adapter cannot run yet waits and is never starved by later requests whose
adapters run."""

import pytest

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.engine import scheduler as scheduler_module
from batchpilot.server.engine.sequence import Status
from tests.support.engine import PROMPTS
from tests.support.models import make_adapter

NAMES = [f"a{i}" for i in range(6)]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tier-adapters")
    return {name: make_adapter(tiny_model, root / name, rank=4, seed=10 + i)
            for i, name in enumerate(NAMES)}  # fmt: skip


def lora_llm(model, adapters, **config) -> LLM:
    config = dict(dtype="float32", max_model_len=128, enable_lora=True) | config
    llm = LLM(model, **config)
    for name, path in adapters.items():
        llm.add_lora(name, path)
    return llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def check_tiers(engine) -> None:
    """Before every step: the host tier within max_cpu_loras (a read in flight counts), every
    running or swapped request's adapter the loaded copy, and a waiting request bound only
    to a loaded copy."""
    loras = engine.loras
    registry = loras.registry
    assert len(registry.loaded) + (loras.reader.name is not None) <= registry.capacity
    scheduler = engine.scheduler
    for seq in [*scheduler.running, *scheduler.swapped]:
        if seq.lora_name is not None:
            assert registry.loaded.get(seq.lora_name) is seq.lora, seq
    for seq in scheduler.waiting:
        if seq.lora is not None:
            assert registry.loaded.get(seq.lora_name) is seq.lora, seq


def watch(engine) -> list[str]:
    """Check the tiers before every step; -> the adapters read again, in order."""
    reads = []
    schedule, start = engine.scheduler.schedule, engine.loras.reader.start

    def checked_schedule():
        check_tiers(engine)
        return schedule()

    def counted_start(name, path):
        reads.append(name)
        start(name, path)

    engine.scheduler.schedule = checked_schedule
    engine.loras.reader.start = counted_start
    return reads


def run(engine) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length", out
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def test_more_adapters_than_host_memory_all_serve_as_each_alone(tiny_model, adapters):
    llm = lora_llm(tiny_model, adapters, max_loras=2, max_cpu_loras=3)
    reads = watch(llm.engine)
    names = [*NAMES, None, *reversed(NAMES), "a0", "a5"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    mixed = llm.generate(prompts, greedy(10), use_tqdm=False, lora=names)
    # Served alone, each request on an engine that holds every adapter and one a step.
    alone = lora_llm(tiny_model, adapters, max_loras=1, max_cpu_loras=len(NAMES))
    changed = 0
    for prompt, name, out in zip(prompts, names, mixed, strict=True):
        want = alone.generate(prompt, greedy(10), use_tqdm=False, lora=name)[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids, name
        base = alone.generate(prompt, greedy(10), use_tqdm=False)[0]
        changed += out.outputs[0].token_ids != base.outputs[0].token_ids
    # The adapters change the output: the comparison could not pass by ignoring them.
    assert changed >= len(names) // 2, changed
    assert len(reads) >= len(NAMES) - 3  # the three evicted at registration were read again
    assert llm.engine.list_loras() == NAMES  # every registered one is listed, loaded or not


def test_the_host_tier_evicts_the_least_recently_used_never_one_in_use(tiny_model, adapters):
    three = {name: adapters[name] for name in NAMES[:3]}
    llm = lora_llm(tiny_model, three, max_loras=2, max_cpu_loras=2)
    engine = llm.engine
    registry = engine.loras.registry
    reads = watch(engine)
    assert list(registry.loaded) == ["a1", "a2"]  # a0 went first, a2 took its place
    llm.generate(PROMPTS[0], greedy(2), use_tqdm=False, lora="a1")
    assert list(registry.loaded) == ["a2", "a1"]  # a1 now the most recently used
    llm.generate(PROMPTS[0], greedy(2), use_tqdm=False, lora="a0")
    assert list(registry.loaded) == ["a1", "a0"] and reads == ["a0"]  # a2 was evicted
    # a1 and a0 run; a2's request waits until one of them ends, then evicts that one and
    # never the other, still running.
    engine.add_request("long", PROMPTS[1], greedy(20), lora_name="a1")
    engine.add_request("short", PROMPTS[2], greedy(4), lora_name="a0")
    engine.add_request("late", PROMPTS[3], greedy(4), lora_name="a2")
    engine.step()
    late = engine.seqs["late"]
    assert late.lora is None and late.status == Status.WAITING
    outputs = run(engine)
    assert reads == ["a0", "a2"] and list(registry.loaded) == ["a1", "a2"]
    alone = lora_llm(tiny_model, three, max_loras=1, max_cpu_loras=3)
    for rid, prompt, name, n in [("long", PROMPTS[1], "a1", 20), ("short", PROMPTS[2], "a0", 4),
                                 ("late", PROMPTS[3], "a2", 4)]:  # fmt: skip
        want = alone.generate(prompt, greedy(n), use_tqdm=False, lora=name)[0]
        assert outputs[rid] == want.outputs[0].token_ids, rid


def test_a_request_whose_adapter_cannot_run_is_not_starved(tiny_model, adapters, monkeypatch):
    """max_loras 1 and a stream of a0 requests, one more every step: b waits for a0's to
    drain, lets at most MAX_LORA_OVERTAKES of them go first, then runs while the stream goes
    on. Preferring running adapters alone would keep b waiting for as long as it lasts."""
    monkeypatch.setattr(scheduler_module, "MAX_LORA_OVERTAKES", 3)
    llm = lora_llm(tiny_model, {n: adapters[n] for n in ("a0", "a1")}, max_loras=1)
    engine = llm.engine
    engine.add_request("first", PROMPTS[0], greedy(6), lora_name="a0")
    engine.step()
    engine.add_request("b", PROMPTS[1], greedy(3), lora_name="a1")
    b = engine.seqs["b"]
    finished_at = None
    for step in range(40):
        engine.add_request(f"s{step}", PROMPTS[step % len(PROMPTS)], greedy(6), lora_name="a0")
        for out in engine.step():
            if out.request_id == "b" and out.finished:
                finished_at = step
    assert finished_at is not None and finished_at < 30, finished_at
    assert b.lora_overtaken == 3  # later a0 requests did go first, as many as allowed
    run(engine)


@pytest.mark.parametrize("overtakes", [scheduler_module.MAX_LORA_OVERTAKES, 0])
def test_a_free_place_goes_first_to_an_adapter_in_a_device_slot(tiny_model, adapters,
                                                                 monkeypatch, overtakes):  # fmt: skip
    """Two slots, a0 running and a1 still in the other: of x (a2, to be copied in) and y (a1,
    behind it), y takes the one free place and x waits for the next. Overtakes bound this as
    any: with none allowed, x, owed its turn, goes first."""
    monkeypatch.setattr(scheduler_module, "MAX_LORA_OVERTAKES", overtakes)
    three = {name: adapters[name] for name in NAMES[:3]}
    llm = lora_llm(tiny_model, three, max_loras=2, max_cpu_loras=3)
    engine = llm.engine
    llm.generate(PROMPTS[0], greedy(2), use_tqdm=False, lora="a1")
    engine.add_request("long", PROMPTS[1], greedy(8), lora_name="a0")
    engine.step()
    slots = engine.runner.lora_slots
    assert [slots.holds(engine.loras.registry.loaded[n]) for n in NAMES[:3]] == [True, True, False]
    engine.add_request("x", PROMPTS[2], greedy(4), lora_name="a2")
    engine.add_request("y", PROMPTS[3], greedy(4), lora_name="a1")
    engine.step()
    first, second = ("y", "x") if overtakes else ("x", "y")
    assert engine.seqs[first].status == Status.RUNNING
    assert engine.seqs[second].status == Status.WAITING
    assert engine.seqs["x"].lora_overtaken == (1 if overtakes else 0)
    outputs = run(engine)
    alone = lora_llm(tiny_model, three, max_loras=1, max_cpu_loras=3)
    for rid, prompt, name in [("x", PROMPTS[2], "a2"), ("y", PROMPTS[3], "a1")]:
        want = alone.generate(prompt, greedy(4), use_tqdm=False, lora=name)[0]
        assert outputs[rid] == want.outputs[0].token_ids, rid
