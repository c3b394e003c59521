"""OpenAI response shapes, SSE framing and error bodies."""

import json

import pytest
from fastapi.exceptions import RequestValidationError

from batchpilot.server.api import responses as r
from batchpilot.server.api.auth import bearer_token, token_matches
from batchpilot.server.api.errors import error_body, validation_message


def parse_sse(text: str) -> list:
    assert text.endswith("\n\n")
    events = [block.removeprefix("data: ") for block in text.strip().split("\n\n")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_sse_event_is_one_data_line_and_done_terminates():
    event = r.sse({"text": "line\nbreak", "é": "ü"})
    assert event.count("\n") == 2 and event.startswith("data: {")
    assert parse_sse(event + r.DONE) == [{"text": "line\nbreak", "é": "ü"}, "[DONE]"]


def test_chunk_usage_field_follows_stream_options():
    choice = r.completion_choice(0, "hi", None)
    plain = r.chunk("text_completion", "id", "m", 1, [choice])
    assert "usage" not in plain
    with_usage = r.chunk("text_completion", "id", "m", 1, [choice], with_usage_field=True)
    assert with_usage["usage"] is None
    final = r.chunk("text_completion", "id", "m", 1, [], r.usage(3, 4))
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}  # fmt: skip


def test_bodies_have_openai_fields():
    body = r.body("chat.completion", "chatcmpl-1", "m", [r.chat_choice(0, "hey", "stop")],
                  r.usage(1, 1), 5)  # fmt: skip
    assert body["object"] == "chat.completion" and body["created"] == 5
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    models = r.model_list("m", 512, 5)
    assert models["data"][0]["id"] == "m" and models["data"][0]["max_model_len"] == 512
    assert r.new_id("cmpl").startswith("cmpl-") and r.new_id("cmpl") != r.new_id("cmpl")


@pytest.mark.parametrize("status,kind", [(400, "BadRequestError"), (401, "AuthenticationError"),
                                         (429, "RateLimitError"), (409, "ConflictError")])  # fmt: skip
def test_error_body_shape(status, kind):
    assert error_body(status, "why", "p") == {
        "error": {"message": "why", "type": kind, "param": "p", "code": status}
    }


def test_validation_message_names_the_field_and_hides_union_members():
    exc = RequestValidationError([
        {"type": "int_type", "loc": ("body", "prompt", "str"), "msg": "bad", "input": 1},
        {"type": "missing", "loc": ("body", "model"), "msg": "missing", "input": None},
    ])  # fmt: skip
    message, param = validation_message(exc)
    assert param == "prompt" and message == "prompt.str: bad (and 1 more error(s))"
    exc = RequestValidationError([{"type": "json_invalid", "loc": ("body", 7), "msg": "x"}])
    assert validation_message(exc) == ("Malformed JSON in the request body: x", None)


def test_bearer_token_parsing_and_constant_time_match():
    assert bearer_token([(b"authorization", b"Bearer abc")]) == "abc"
    assert bearer_token({"authorization": "bearer  abc "}) == "abc"
    assert bearer_token({"authorization": "abc"}) is None
    assert bearer_token({"authorization": "Basic abc"}) is None
    assert bearer_token({}) is None
    assert token_matches("abc", "abc") and not token_matches("abd", "abc")
    assert not token_matches(None, "abc")
