"""Request validation and the mapping to SamplingParams."""

import pytest
from pydantic import ValidationError

from batchpilot.server.api.errors import APIError
from batchpilot.server.api.protocol import (
    INT64_MAX,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_SEQS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": -1},
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"top_k": -2},
        {"n": 0},
        {"n": 1000},
        {"seed": -1},
        {"stop": ["a"] * 17},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"logit_bias": {"the": 2.0}},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
        {"suffix": "x"},
        {"best_of": 3},
    ],
)
def test_out_of_range_or_unsupported_completion_fields_are_rejected(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", **fields)


@pytest.mark.parametrize("prompt", ["", [], [[]], [-1], {"a": 1}, [1, "a"]])
def test_malformed_prompts_are_rejected_except_empty_string(prompt):
    if prompt == "":
        assert CompletionRequest(prompt=prompt).prompts() == [""]  # the engine rejects it
    else:
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=prompt)


def test_prompt_shapes_normalize_to_a_list_of_prompts():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_unknown_fields_are_ignored_like_openai():
    assert CompletionRequest(prompt="a", some_future_field=3).prompt == "a"


def test_include_usage_only_when_streaming():
    options = {"include_usage": True}
    assert CompletionRequest(prompt="a", stream=True, stream_options=options).include_usage
    assert not CompletionRequest(prompt="a", stream=False, stream_options=options).include_usage
    assert not CompletionRequest(prompt="a", stream=True).include_usage


def test_chat_messages_text_parts_roles_and_limits():
    body = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )  # fmt: skip
    assert body.template_messages() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},
    ]
    for bad in ([], [{"role": "wizard", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]):  # fmt: skip
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=bad)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=0)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[{"type": "f"}])


def test_sampling_params_defaults_and_seed_per_choice():
    body = CompletionRequest(prompt="a", seed=INT64_MAX, top_k=5, stop="x", ignore_eos=True)
    first, second = sampling_params(body, 7, 0), sampling_params(body, 7, 1)
    assert (first.max_tokens, first.temperature, first.top_p, first.top_k) == (7, 1.0, 1.0, 5)
    assert first.stop_strings == ("x",) and first.ignore_eos
    assert (first.seed, second.seed) == (INT64_MAX, 0)  # wraps instead of overflowing int64
    unseeded = sampling_params(CompletionRequest(prompt="a", temperature=0), 3, 2)
    assert unseeded.seed is None and unseeded.greedy


def test_sampling_params_errors_become_400():
    body = CompletionRequest(prompt="a", stop=[""])
    with pytest.raises(APIError) as info:
        sampling_params(body, 4, 0)
    assert info.value.status == 400 and "stop" in info.value.message


def test_vllm_sampling_knobs_and_logprobs_reach_sampling_params():
    body = CompletionRequest(prompt="hi", presence_penalty=0.5, frequency_penalty=-0.5,
                             repetition_penalty=1.2, min_p=0.1, min_tokens=2, echo=True,
                             logit_bias={"7": 300.0, "9": -1.5}, logprobs=3)  # fmt: skip
    params = sampling_params(body, 8, 0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_p, params.min_tokens) == (0.5, -0.5, 1.2, 0.1, 2)  # fmt: skip
    assert params.logit_bias == {7: 100.0, 9: -1.5}  # clamped to OpenAI's [-100, 100]
    assert (params.logprobs, params.prompt_logprobs) == (3, 3)  # echo scores the prompt
    assert CompletionRequest(prompt="hi", max_tokens=0, echo=True).max_tokens == 0
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                 top_logprobs=2)  # fmt: skip
    assert sampling_params(chat, 8, 0).logprobs == 2
    with pytest.raises(ValidationError, match="top_logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(APIError):
        sampling_params(CompletionRequest(prompt="hi", min_tokens=9), 8, 0)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": float("nan")},
        {"top_p": float("nan")},
        {"repetition_penalty": float("inf")},
        {"presence_penalty": float("-inf")},
        {"min_p": float("nan")},
        {"logit_bias": {"1": float("inf")}},
        {"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
        {"stop": "x" * (MAX_STOP_STRING_CHARS + 1)},
        {"stop": ["ok", "y" * (MAX_STOP_STRING_CHARS + 1)]},
        {"top_k": INT64_MAX + 1},
        {"stop_token_ids": [INT64_MAX + 1]},
        {"prompt": ["a"] * MAX_SEQS_PER_REQUEST, "n": 2},
        {"prompt": [[1]] * (MAX_SEQS_PER_REQUEST + 1)},
        {"prompt": [1] + [[1]] * MAX_SEQS_PER_REQUEST},  # a batch disguised as token ids
    ],
)
def test_non_finite_floats_and_oversized_fields_are_rejected(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**{"prompt": "hi", **fields})


def test_the_bounds_themselves_are_accepted():
    body = CompletionRequest(prompt=["a"] * MAX_SEQS_PER_REQUEST, stop=["x" * MAX_STOP_STRING_CHARS],
                             logit_bias={str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)})  # fmt: skip
    assert len(body.prompts()) == MAX_SEQS_PER_REQUEST
    # A long token-id prompt is one prompt, not a batch: max_model_len bounds it.
    assert CompletionRequest(prompt=[1] * (MAX_SEQS_PER_REQUEST + 1)).prompts() == [
        [1] * (MAX_SEQS_PER_REQUEST + 1)
    ]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=MAX_N)
    assert chat.n == MAX_N


def test_a_huge_prompt_batch_is_refused_before_its_items_are_validated():
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt=[[1]] * 500_000, n=MAX_N)
    assert info.value.error_count() == 1  # not one per item and union member


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": float("inf")},
        {"repetition_penalty": float("inf")},
        {"top_p": float("nan")},
        {"logit_bias": {1: float("nan")}},
    ],
)
def test_sampling_params_refuse_non_finite_floats(fields):
    from batchpilot.server.sampling.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="finite"):
        SamplingParams(**fields)
