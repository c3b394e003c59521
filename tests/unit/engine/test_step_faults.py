"""A step that raises fails only its requests and leaves the engine consistent: a fault
in one sequence's sampling fails that request alone (the others sample exactly what they
would have), a fault in the forward fails the step's batch, and either way the KV blocks
are freed, no block the failed step was filling stays in the prefix cache, and the
engine serves the next requests as a fresh one would. Faults are injected by
monkeypatching the sampler and the model runner."""

import pytest

from batchpilot.server.engine.admission import RequestRejected
from batchpilot.server.engine.llm_engine import LLMEngine
from batchpilot.server.engine.step_faults import StepFailed
from batchpilot.server.kv.block_pool import block_digest
from batchpilot.server.sampling import sampler
from batchpilot.server.sampling.sampling_params import SamplingParams

POISON_SEED = 666
LONG_PROMPT = "the quick brown fox jumps over the lazy dog, again and again. " * 4


@pytest.fixture
def engine(tiny_model):
    return LLMEngine(model=tiny_model, dtype="float32", max_model_len=256,
                     kv_cache_memory_bytes=8 << 20, swap_space_bytes=1 << 20)  # fmt: skip


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.8, seed=seed, ignore_eos=True)


def run(engine, requests) -> tuple[dict, int]:
    """requests: (id, prompt, SamplingParams) -> ({id: (text, error)}, failed steps)."""
    for rid, prompt, p in requests:
        engine.add_request(rid, prompt, p)
    finished, failed_steps = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except StepFailed as failed:
            outs, failed_steps = failed.outputs, failed_steps + 1
        finished.update({o.request_id: (o.outputs[0].text, o.error) for o in outs if o.finished})
    return finished, failed_steps


def assert_clean(engine) -> None:
    pool = engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks
    assert not engine.seqs and not engine.output_processor.requests


def test_a_fault_in_one_sequences_sampling_fails_only_that_request(engine, monkeypatch):
    batch = [("a", "hello there", params(1)), ("x", "another prompt", params(POISON_SEED + 1)),
             ("b", "once upon a time", params(2))]  # fmt: skip
    expected, _ = run(engine, batch)
    real_sample = sampler.sample

    def faulty_sample(logits, seqs, mode):
        if any(s.params.seed == POISON_SEED for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real_sample(logits, seqs, mode)

    monkeypatch.setattr(sampler, "sample", faulty_sample)
    poisoned = [(f"{rid}2", prompt, params(POISON_SEED if rid == "x" else p.seed))
                for rid, prompt, p in batch]  # fmt: skip
    got, failed_steps = run(engine, poisoned)

    assert failed_steps == 0  # pinned to one sequence: the step itself succeeded
    assert got["x2"][1] is not None and got["x2"][0] == ""
    # The others drew exactly what they drew without the fault, seeds and all.
    assert got["a2"] == (expected["a"][0], None) and got["b2"] == (expected["b"][0], None)
    assert_clean(engine)


def test_a_forward_fault_fails_the_batch_and_forgets_the_blocks_it_was_filling(
    engine, tiny_model, monkeypatch
):
    fresh = LLMEngine(model=tiny_model, dtype="float32", max_model_len=256,
                      kv_cache_memory_bytes=8 << 20, swap_space_bytes=1 << 20)  # fmt: skip
    expected, _ = run(fresh, [("c", LONG_PROMPT, params(3))])
    real_forward = engine.runner._forward
    calls = []

    def forward_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "_forward", forward_failing_once)
    got, failed_steps = run(engine, [("c", LONG_PROMPT, params(3)), ("d", "hi", params(4))])

    assert failed_steps == 1
    assert all(error is not None for _, error in got.values()) and set(got) == {"c", "d"}
    assert_clean(engine)
    ids = engine.tokenizer(LONG_PROMPT)["input_ids"]
    first_block = block_digest(None, ids[: engine.config.block_size])
    assert first_block not in engine.kv_manager.pool.cached  # its K/V was never written
    # The same prompt again: computed afresh, as a fresh engine computes it.
    again, failed_steps = run(engine, [("c2", LONG_PROMPT, params(3))])
    assert failed_steps == 0 and again["c2"] == expected["c"]
    assert_clean(engine)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"stop_token_ids": [10**9], "min_tokens": 2}, "stop_token_ids"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"top_k": 10**9}, "top_k"),
    ],
)
def test_out_of_vocabulary_ids_and_top_k_are_rejected(engine, fields, message):
    with pytest.raises(RequestRejected, match=message):
        engine.add_request("r", "hi", SamplingParams(max_tokens=4, **fields))
    assert_clean(engine)


def test_a_tokens_prompt_keeps_its_text_and_is_not_tokenized_again(engine):
    ids = engine.tokenizer("hello")["input_ids"]
    engine.add_request("t", {"prompt_token_ids": ids, "prompt": "shown on echo"},
                       SamplingParams(max_tokens=2))  # fmt: skip
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].prompt == "shown on echo" and outs[-1].prompt_token_ids == ids
