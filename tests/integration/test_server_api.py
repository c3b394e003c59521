"""`batchpilot serve` on the tiny random Llama, driven over 127.0.0.1 by the openai client:
completions and chat, streamed and not, continuous batching across HTTP requests, bad
input, the API key, the admin API and /metrics."""

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest

from batchpilot import names
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

API_KEY = "sk-test-api-key-7f3a"
ADMIN_TOKEN = "admin-token-91c2"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    args = ["--model", tiny_path, "--served-model-name", MODEL, *TINY_FLAGS,
            "--api-key", API_KEY, "--admin-token", ADMIN_TOKEN, "--max-num-seqs", "64",
            "--max-request-body-bytes", "65536"]  # fmt: skip
    log = tmp_path_factory.mktemp("server") / "serve.log"
    proc = ServerProcess(args, log, api_key=API_KEY).start()
    yield proc
    proc.stop()
    assert API_KEY not in proc.log() and ADMIN_TOKEN not in proc.log(), "a secret was logged"


@pytest.fixture(scope="module")
def offline(tiny_path):
    from batchpilot.server import LLM

    return LLM(model=tiny_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory_bytes=16 << 20, swap_space_bytes=1 << 20)  # fmt: skip


def greedy(offline, prompts, max_tokens):
    from batchpilot.server import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]


def test_completion_matches_offline_greedy_with_usage(server, offline):
    client = server.client()
    out = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = offline.get_tokenizer()("The capital of France is")["input_ids"]
    assert out.choices[0].text == greedy(offline, ["The capital of France is"], 12)[0]
    assert out.choices[0].finish_reason == "length"
    assert out.model == MODEL and out.object == "text_completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 12)
    assert out.usage.total_tokens == len(prompt_ids) + 12


def test_streamed_completion_equals_unstreamed_and_reports_usage(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not(server, offline):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    ids = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == greedy(offline, [ids], 8)[0]
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_with_seed_are_reproducible(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="Pick a word:", max_tokens=6, temperature=1.0, n=3,
                  seed=1234, extra_body={"ignore_eos": True})  # fmt: skip
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1, (
        "seed + i must give the choices different streams"
    )
    assert first.usage.completion_tokens == 18


def test_stop_string_truncates_and_reports_stop(server, offline):
    full = greedy(offline, ["Hello there"], 24)[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assume_found = full.index(stop)
    out = server.client().completions.create(model=MODEL, prompt="Hello there", max_tokens=24,
                                             temperature=0, stop=[stop],
                                             extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == full[:assume_found]
    assert out.choices[0].finish_reason == "stop"


def test_32_concurrent_streams_complete_with_offline_greedy_text(server, offline):
    prompts = [f"Request number {i} says" for i in range(32)]
    expected = greedy(offline, prompts, 16)

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
        parts, reasons = [], []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        return "".join(parts), reasons[-1]

    async def all_of_them():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    batch_before = server.metric(names.BATCH_SIZE + "_sum")
    steps_before = server.metric(names.BATCH_SIZE + "_count")
    results = asyncio.run(all_of_them())
    assert [text for text, _ in results] == expected
    assert all(reason == "length" for _, reason in results)
    # Continuous batching across HTTP requests: steps ran many sequences at once.
    steps = server.metric(names.BATCH_SIZE + "_count") - steps_before
    mean_batch = (server.metric(names.BATCH_SIZE + "_sum") - batch_before) / steps
    assert mean_batch > 4, f"mean batch size {mean_batch:.1f}: requests were not batched"


def test_api_key_guards_every_route_but_probes_and_metrics(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == 401 and r.json()["error"]["message"]
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                         ("GET", "/openapi.json"), ("GET", "/docs")):  # fmt: skip
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "hi", "tokens": [1]})
        assert r.status_code == 401, path
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}, headers=key).json()["count"]
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert [m.id for m in server.client().models.list().data] == [MODEL]


def long_stream(
    server, max_tokens: int, results: list, prompt: str = "Keep going"
) -> threading.Thread:
    """A streamed request in a thread; appends (text, finish_reason, completion tokens)."""

    def run():
        stream = server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        results.append((text, reason, chunks[-1].usage.completion_tokens))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


BAD_BODIES = {
    "malformed json": (b'{"prompt": "hi", "max_tokens": ', None),
    "max_tokens 0": ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    "temperature < 0": ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    "top_p 0": ({"prompt": "hi", "top_p": 0}, "top_p"),
    "top_k 0": ({"prompt": "hi", "top_k": 0}, None),
    "n 0": ({"prompt": "hi", "n": 0}, "n"),
    "missing prompt": ({"max_tokens": 3}, "prompt"),
    "prompt wrong type": ({"prompt": {"a": 1}}, "prompt"),
    "empty stop string": ({"prompt": "hi", "stop": [""]}, None),
    "token id out of vocab": ({"prompt": [10**9]}, None),
    "empty prompt": ({"prompt": ""}, None),
    "logprobs over 20": ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    "suffix unsupported": ({"prompt": "hi", "suffix": "x"}, None),
}


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.http() as http:
        return http.post(path, content=content, headers={"Content-Type": "application/json"})


def assert_openai_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    return error


def test_bad_input_gets_clear_errors_and_running_requests_are_unaffected(server):
    results: list = []
    runner = long_stream(server, 200, results)
    wait_for(
        "a running request", lambda: server.metric(names.NUM_REQUESTS_RUNNING) >= 1, interval=0.05
    )
    for name, (body, param) in BAD_BODIES.items():
        error = assert_openai_error(post(server, "/v1/completions", body), 400, param)
        assert name and error["message"]
    # An unknown model is vLLM's 404 NotFoundError (the openai client's NotFoundError).
    unknown = post(server, "/v1/completions", {"model": "gpt-nope", "prompt": "hi"})
    error = assert_openai_error(unknown, 404, "model")
    assert error == {"message": "The model `gpt-nope` does not exist.", "type": "NotFoundError",
                     "param": "model", "code": 404}  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().completions.create(model="gpt-nope", prompt="hi", max_tokens=1)
    chat_bad = {"messages": [], "max_tokens": 3}
    assert_openai_error(post(server, "/v1/chat/completions", chat_bad), 400, "messages")
    chat_bad = {"messages": [{"role": "wizard", "content": "x"}]}
    assert_openai_error(post(server, "/v1/chat/completions", chat_bad), 400)

    too_long = {"prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 1}
    error = assert_openai_error(post(server, "/v1/completions", too_long), 400)
    assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN}")
    over = {"prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN}
    error = assert_openai_error(post(server, "/v1/completions", over), 400)
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
        f"requested {100 + MAX_MODEL_LEN} tokens (100 in the messages, {MAX_MODEL_LEN} in the "
        "completion). Please reduce the length of the messages or completion."
    )
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 600}], max_tokens=4
        )
    huge = {"prompt": "x" * 70_000}
    assert_openai_error(post(server, "/v1/completions", huge), 413)

    runner.join(60)
    assert results and results[0][1:] == ("length", 200), results


def test_oversized_chunked_body_gets_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    with server.http() as http:
        r = http.post(
            "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
    assert_openai_error(r, 413)


def test_admin_api_auth_and_live_max_num_seqs(server):
    # Only on its own port: the public one (the Service's) has no /admin at all.
    public = f"{server.url}/admin/config"
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert_openai_error(httpx.get(public, headers=key), 404)
    assert_openai_error(httpx.get(public, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}), 401)
    url = f"{server.admin_url}/admin/config"
    assert_openai_error(httpx.get(url), 401)
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer nope"}), 401)
    assert_openai_error(httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}), 401)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    config = httpx.get(url, headers=admin).json()
    assert config["max_num_seqs"] == 64 and config["max_model_len"] == MAX_MODEL_LEN
    assert_openai_error(httpx.patch(url, json={"max_num_seqs": 0}, headers=admin), 400)
    assert_openai_error(httpx.patch(url, json={"max_num_seqs": "8"}, headers=admin), 400)
    # More sequences than the step budget it started with (512 tokens) cannot run at once.
    error = assert_openai_error(httpx.patch(url, json={"max_num_seqs": 513}, headers=admin), 400)
    assert "at most" in error["message"]
    assert httpx.get(url, headers=admin).json()["max_num_seqs"] == 64
    error = assert_openai_error(httpx.patch(url, json={"block_size": 8}, headers=admin), 400)
    assert "max_num_seqs" in error["message"]
    assert_openai_error(httpx.patch(url, json={"max_num_seqs": 8}), 401)

    # Lowering below the running count lets the running sequences finish.
    results: list = []
    runners = [long_stream(server, 120, results, f"stream {i}") for i in range(4)]
    wait_for(
        "4 running requests", lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 4, interval=0.05
    )
    patched = httpx.patch(url, json={"max_num_seqs": 2}, headers=admin)
    assert patched.status_code == 200 and patched.json()["max_num_seqs"] == 2
    assert server.metric(names.MAX_NUM_SEQS_METRIC, model_name=MODEL) == 2
    assert httpx.get(url, headers=admin).json()["max_num_seqs"] == 2
    for t in runners:
        t.join(120)
    assert sorted(r[1:] for r in results) == [("length", 120)] * 4
    patched = httpx.patch(url, json={"max_num_seqs": 64}, headers=admin)
    assert server.metric(names.MAX_NUM_SEQS_METRIC, model_name=MODEL) == 64


def step_count(server, le: str | None = None) -> float:
    """Engine steps so far (with le: those of at most le tokens), from the histogram."""
    if le is None:
        return server.metric(f"{names.ITERATION_TOKENS}_count", model_name=MODEL)
    return server.metric(f"{names.ITERATION_TOKENS}_bucket", model_name=MODEL, le=le)


def test_admin_api_live_step_budget(server):
    url = f"{server.admin_url}/admin/config"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    budget = names.MAX_NUM_BATCHED_TOKENS.name

    def in_force() -> tuple:
        config = httpx.get(url, headers=admin).json()
        gauge = server.metric(names.MAX_NUM_BATCHED_TOKENS_METRIC, model_name=MODEL)
        return config["max_num_seqs"], config[budget], gauge

    # Started on a CPU with 512-token steps (the default there) and 64 sequences.
    assert in_force() == (64, 512, 512)
    for body, needle in [
        ({budget: 513}, "512-token step"),
        ({budget: 63}, "max_num_seqs 64"),
        ({"max_num_seqs": 32, budget: 31}, "max_num_seqs 32"),
        ({budget: "64"}, "integer"),
        ({budget: 64.0}, "integer"),
        ({budget: True}, "integer"),
    ]:
        error = assert_openai_error(httpx.patch(url, json=body, headers=admin), 400)
        assert needle in error["message"], error
    assert in_force() == (64, 512, 512)

    try:
        patched = httpx.patch(url, json={"max_num_seqs": 8, budget: 16}, headers=admin)
        assert patched.status_code == 200 and patched.json()[budget] == 16, patched.text
        assert in_force() == (8, 16, 16)
        # The next steps keep to it: an 80-token prompt's prefill takes five or more.
        steps, small = step_count(server), step_count(server, le="16.0")
        prompt = [1000 + 7 * i for i in range(80)]
        server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert step_count(server) - steps >= 5
        assert step_count(server, le="16.0") - small == step_count(server) - steps
    finally:
        httpx.patch(url, json={"max_num_seqs": 64, budget: 512}, headers=admin)
    assert in_force() == (64, 512, 512)


def test_metrics_expose_every_name_with_model_label(server):
    server.client().completions.create(model=MODEL, prompt="metrics", max_tokens=4)
    samples = server.metrics()
    for name in names.ALL_METRICS:
        matching = [k for k in samples if k == name or k.startswith((name + "{", name + "_"))]
        assert matching, f"{name} missing from /metrics"
        assert all(f"{names.METRIC_LABEL}={MODEL}" in k for k in matching), matching
    info = [k for k in samples if k.startswith(names.KV_CACHE_INFO)]
    assert "block_size=16" in info[0] and "dtype=auto" in info[0]
    assert samples[f"{names.TIME_TO_FIRST_TOKEN}_count{{model_name={MODEL}}}"] >= 1
    assert samples[f"{names.E2E_REQUEST_LATENCY}_count{{model_name={MODEL}}}"] >= 1
    assert samples[f"{names.GENERATION_TOKENS}{{model_name={MODEL}}}"] >= 4
    assert 0.0 <= samples[f"{names.KV_CACHE_USAGE}{{model_name={MODEL}}}"] <= 1.0


def raw_post(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    return head.encode() + payload


def idle_and_freed(server) -> bool:
    return (server.metric(names.NUM_REQUESTS_RUNNING) == 0
            and server.metric(names.KV_CACHE_USAGE) == 0.0)  # fmt: skip


@pytest.mark.parametrize("streamed", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_aborts_and_frees_blocks(server, streamed):
    wait_for("the server idle, its KV blocks freed", lambda: idle_and_freed(server), interval=0.05)
    generated_before = server.metric(names.GENERATION_TOKENS)
    body = {"prompt": "never mind", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": streamed}  # fmt: skip
    with server.http() as http:
        if streamed:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                assert server.metric(names.KV_CACHE_USAGE) > 0
        else:
            # A raw socket closed once the request runs: a client timeout would race the
            # generation, which a quiet machine finishes in well under a second.
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(raw_post("/v1/completions", body))
                wait_for(
                    "1 running request",
                    lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 1,
                    interval=0.005,
                )
    wait_for(
        "the server idle, its KV blocks freed",
        lambda: idle_and_freed(server),
        timeout=10,
        interval=0.05,
    )
    generated = server.metric(names.GENERATION_TOKENS) - generated_before
    assert generated < 400, "the request ran to completion instead of being aborted"
