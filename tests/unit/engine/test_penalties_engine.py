"""Each logits processor changes the tiny model's next-token distribution exactly as
vLLM's formula says. With logprobs_mode "processed_logprobs" the engine reports the
distribution it sampled from; the test rebuilds that distribution from transformers'
float32 logits with the formula written out, position by position."""

import pytest
import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model.loader import load_hf_model

PROMPT = "one two three one two three one two"
MAX_TOKENS = 8
NUM_LOGPROBS = 20
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", max_model_len=128, logprobs_mode="processed_logprobs")


@pytest.fixture(scope="module")
def hf_logits(tiny_model):
    model, _ = load_hf_model(tiny_model, torch.float32)

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()

    return logits


def presence(row, prompt, output, p):
    for t in set(output):
        row[t] -= p
    return row


def frequency(row, prompt, output, f):
    for t in output:
        row[t] -= f
    return row


def repetition(row, prompt, output, r):
    for t in set(prompt) | set(output):
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    return row


def bias(row, prompt, output, biases):
    for t, b in biases.items():
        row[t] += b
    return row


def greedy_token(hf_logits, ids):
    return int(hf_logits(ids)[-1].argmax())


CASES = {
    "presence_penalty": (dict(presence_penalty=1.5), presence, 1.5),
    "frequency_penalty": (dict(frequency_penalty=0.75), frequency, 0.75),
    "repetition_penalty": (dict(repetition_penalty=1.8), repetition, 1.8),
    "negative_penalties": (dict(presence_penalty=-1.0), presence, -1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_penalty_follows_the_formula(llm, hf_logits, case):
    knobs, formula, value = CASES[case]
    check(llm, hf_logits, lambda row, p, o: formula(row, p, o, value), **knobs)


def test_logit_bias_follows_the_formula(llm, hf_logits):
    prompt = llm.get_tokenizer()(PROMPT)["input_ids"]
    first = greedy_token(hf_logits, prompt)
    biases = {first: -4.0, 7: 6.0, 1000: 2.5}
    check(llm, hf_logits, lambda row, p, o: bias(row, p, o, biases), logit_bias=biases)


def test_min_tokens_holds_back_stop_tokens(llm, hf_logits):
    prompt = llm.get_tokenizer()(PROMPT)["input_ids"]
    stop = greedy_token(hf_logits, prompt)  # greedy would stop at once without min_tokens

    def formula(row, p, o):
        if len(o) < 3:
            row[stop] = float("-inf")
        return row

    out = check(llm, hf_logits, formula, min_tokens=3, stop_token_ids=[stop])
    assert stop not in out.token_ids[:3]
    if stop in out.token_ids:
        assert out.token_ids[-1] == stop and out.stop_reason == stop


def test_min_p_after_temperature(llm, hf_logits):
    def formula(row, p, o):
        row = row / 0.7
        probs = row.softmax(-1)
        return row.masked_fill(probs < 0.2 * probs.max(), float("-inf"))

    check(llm, hf_logits, formula, temperature=0.7, min_p=0.2, seed=5)


def check(llm, hf_logits, formula, **knobs):
    """Generate with knobs; at every output position, compare the reported logprobs with
    log_softmax(formula(transformers' logits, prompt ids, output ids so far))."""
    knobs = {"temperature": 0.0, **knobs}
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS,
                            **knobs)  # fmt: skip
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    prompt, output = out.prompt_token_ids, completion.token_ids
    logits = hf_logits(prompt + output)
    for j, (token, position) in enumerate(zip(output, completion.logprobs, strict=True)):
        row = formula(logits[len(prompt) - 1 + j].clone(), prompt, output[:j])
        expected = torch.log_softmax(row, dim=-1)
        if params.greedy:
            assert token == int(row.argmax())
        assert position[token].logprob == pytest.approx(expected[token].item(), abs=ATOL)
        top = sorted((lp.rank, lp.logprob) for t, lp in position.items() if lp.rank <= NUM_LOGPROBS)
        values = expected.topk(NUM_LOGPROBS).values
        finite = torch.isfinite(values)
        got = torch.tensor([v for _, v in top])
        torch.testing.assert_close(got[finite], values[finite], rtol=0, atol=ATOL)
    return completion
