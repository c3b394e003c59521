"""`batchpilot serve` with no --model serves the bundled SmolLM2: chat and completions,
streamed and not, greedy text identical to offline LLM.generate."""

import pytest

from batchpilot import names
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
         "--swap-space", "0.05")  # fmt: skip
MODEL = names.DEFAULT_SERVED_MODEL_NAME


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(list(FLAGS), tmp_path_factory.mktemp("bundled") / "serve.log").start()
    yield proc
    proc.stop()


def test_bundled_model_chat_and_completion_match_offline(server):
    from batchpilot.server import LLM, SamplingParams

    offline = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20,
                  swap_space_bytes=1 << 20)  # fmt: skip
    client = server.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                          temperature=0)  # fmt: skip
    ids = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = offline.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == expected.text
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens == len(expected.token_ids)

    stream = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=8, temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].text for c in stream)
    prompt_out = offline.generate(["The capital of France is"], SamplingParams(max_tokens=8,
                                  temperature=0.0), use_tqdm=False)  # fmt: skip
    assert text == prompt_out[0].outputs[0].text
