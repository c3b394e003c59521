"""Logprobs over HTTP on the tiny random Llama: the official openai client reads them
from completions and chat, streamed and not; echo and prompt logprobs; /tokenize,
/detokenize and /version; and lm-evaluation-harness's local-completions model scores a
multiple-choice task against the live server with the offline engine's log-likelihoods."""

import json
import math

import pytest

from tests.support.servers import TINY_FLAGS, ServerProcess

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    args = ["--model", tiny_path, "--served-model-name", MODEL, *TINY_FLAGS]
    proc = ServerProcess(args, tmp_path_factory.mktemp("server") / "serve.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(tiny_path):
    from batchpilot.server import LLM

    return LLM(model=tiny_path, dtype="float32", max_model_len=512)


def prompt_scores(offline, prompt_ids: list[int]) -> list[float]:
    """The offline engine's logprob of each prompt token after the first."""
    from batchpilot.server import SamplingParams

    out = offline.generate({"prompt_token_ids": prompt_ids},
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]  # fmt: skip
    return [pos[t].logprob for t, pos in zip(prompt_ids[1:], out.prompt_logprobs[1:], strict=True)]


def test_completion_logprobs_streamed_and_not(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                  logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == whole.text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) == 3  # greedy: the chosen token is the top one
        assert max(top.values()) == pytest.approx(logprob) and token in top
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    # A chunk's text may lag its tokens (held back for a stop string or a split character);
    # over the stream, the text and the tokens' logprobs are the whole response's.
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert "".join(c.text for c in chunks) == whole.text
    assert "".join(t for lp_ in streamed for t in lp_.tokens) == "".join(lp.tokens)
    assert [x for lp_ in streamed for x in lp_.token_logprobs] == pytest.approx(
        lp.token_logprobs, abs=1e-5
    )


def test_echo_returns_prompt_logprobs_first_null(server, offline):
    prompt = "Paris is the capital of France"
    ids = offline.get_tokenizer()(prompt)["input_ids"]
    expected = prompt_scores(offline, ids)
    client = server.client()
    for max_tokens in (0, 2):
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, echo=True, logprobs=1).choices[0]  # fmt: skip
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert "".join(lp.tokens[: len(ids)]) == prompt
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None


def test_suffix_and_out_of_range_logprobs_are_refused(server):
    http = server.http()
    for body, param in (({"suffix": "x"}, "suffix"), ({"logprobs": 21}, "logprobs"),
                        ({"max_tokens": 0}, "max_tokens")):  # fmt: skip
        r = http.post("/v1/completions", json={"prompt": "Hi", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError"
        assert param in error["message"]


def test_chat_logprobs_streamed_and_not(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    content = choice.logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                streamed.extend(c.logprobs.content)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    no_logprobs = client.chat.completions.create(**{**kwargs, "logprobs": False,
                                                    "top_logprobs": None})  # fmt: skip
    assert no_logprobs.choices[0].logprobs is None


def test_tokenize_detokenize_and_version(server, offline):
    http = server.http()
    tokenizer = offline.get_tokenizer()
    body = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer("Hello world")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "Hi!"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                tokenize=True, return_dict=False))  # fmt: skip
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert http.get("/version").json()["version"]


TASK = """
task: batchpilot_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a cat"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]


def test_lm_eval_local_completions_scores_like_the_offline_engine(server, offline, tiny_path,
                                                                  tmp_path, monkeypatch):  # fmt: skip
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    model_args = (f"base_url={server.url}/v1/completions,model={MODEL},tokenizer={tiny_path},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1")  # fmt: skip
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=["batchpilot_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
        bootstrap_iters=0,
    )  # fmt: skip
    samples = results["samples"]["batchpilot_tiny_mc"]
    assert len(samples) == len(DOCS)
    tokenizer = offline.get_tokenizer()
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(
            sample["arguments"], sample["filtered_resps"], strict=True
        ):  # fmt: skip
            ctx, cont = encode_pair(tokenizer, context, continuation)
            expected = sum(prompt_scores(offline, ctx + cont)[len(ctx) - 1 :])
            assert math.isclose(loglikelihood, expected, abs_tol=1e-3), (context, continuation)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens: trailing spaces
    move to the continuation, and the continuation is what the whole adds to the context."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ctx = encode(context)
    return ctx, encode(context + continuation)[len(ctx) :]
