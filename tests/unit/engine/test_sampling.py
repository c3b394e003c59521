"""Sampler, stop conditions and incremental detokenization."""

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.output.detokenizer import IncrementalDetokenizer
from batchpilot.server.sampling.sampler import sample


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", max_model_len=256)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)  # fmt: skip
    alone = llm.generate(["Tell me a story"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.7, ignore_eos=True) for n in (5, 30, 12)]
    batch = llm.generate(["Hi", "Tell me a story", "Why?", "x y z"],
                         [others[0], params, others[1], others[2]], use_tqdm=False)  # fmt: skip
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate(["Tell me a story"], dataclasses.replace(params, seed=99), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(["Count: one"], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True), use_tqdm=False)  # fmt: skip
    for params in (SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True)):  # fmt: skip
        out = llm.generate(["Count: one"], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_sampler_follows_the_distribution_and_respects_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seq = Sequence("s", None, [0], SamplingParams(temperature=1.0, top_k=2), generator=gen)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits.clone(), [seq]).token_ids[0]] += 1
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.03


def test_stop_strings_truncate_and_finish(llm):
    free = llm.generate(["Once upon"], SamplingParams(max_tokens=30, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)  # fmt: skip
    text = free[0].outputs[0].text
    stop = text[10:14]
    out = llm.generate(["Once upon"], SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                                      ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text == text[: text.find(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[4]
    out = llm.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)  # fmt: skip
    first = free.token_ids.index(stop_id)
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].token_ids == free.token_ids[: first + 1]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0),
                                 dict(top_k=0), dict(n=0), dict(stop=[""])])  # fmt: skip
def test_invalid_sampling_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_incremental_detokenizer_handles_split_multibyte_characters(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "机器学习是人工智能的一个分支。🤖 naïve café"
    ids = tokenizer(text)["input_ids"]
    # Byte-level BPE splits some of these characters across tokens.
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_unseeded_requests_draw_seeds_from_the_os_unless_the_engine_has_a_seed(tiny_model):
    # Two replicas (or one after a restart) must not repeat each other's series: a client
    # that learned one could predict another client's samples.
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)

    def unseeded_tokens(seed):
        engine = LLM(tiny_model, dtype="float32", max_model_len=64, seed=seed)
        return [o.outputs[0].token_ids for o in engine.generate(["a", "b"], params, use_tqdm=False)]

    assert unseeded_tokens(None) != unseeded_tokens(None)
    assert unseeded_tokens(7) == unseeded_tokens(7)
