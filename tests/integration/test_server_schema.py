"""Schemathesis against the running server's own OpenAPI schema, every operation of the
public app: whatever it generates, valid or not, the server answers without a 5xx, and
it still serves a normal request afterwards."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.support.servers import ServerProcess

# Per operation and mode: requests valid by the schema and, for the operations with a body,
# requests that break it. So 200 each for completions, chat, /tokenize and /detokenize
# (the GET routes take no input: one each); about a minute on two loaded cores.
EXAMPLES = 100

# A short context keeps every generated request cheap on two CPU cores.
FLAGS = ("--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory", "16MiB",
         "--swap-space", "0.02", "--served-model-name", "tiny")  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.models import make_tiny_llama

    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    proc = ServerProcess(["--model", tiny, *FLAGS], tmp_path_factory.mktemp("s") / "serve.log")
    yield proc.start()
    proc.stop()


def fuzz(operation, mode: GenerationMode, statuses: list[int]) -> int:
    """EXAMPLES cases of operation in mode, each checked for a 5xx -> how many ran."""
    before = len(statuses)

    # Driven through hypothesis directly: schemathesis' pytest plugin does not load under
    # this pytest, and a plain loop keeps the server fixture simple.
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def never_5xx(case):
        response = case.call_and_validate(checks=[not_a_server_error], timeout=60)
        statuses.append(response.status_code)

    never_5xx()
    return len(statuses) - before


def test_the_api_never_answers_5xx_and_still_serves_afterwards(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/tokenize", "/detokenize"}  # fmt: skip
    statuses: list[int] = []
    counts = {}
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":  # the ones with a body to break
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            key = f"{operation.method.upper()} {operation.path} {mode.value}"
            counts[key] = fuzz(operation, mode, statuses)
    print("schemathesis examples:", counts)
    # Both accepted and rejected requests were generated, so both paths were exercised.
    assert 200 in statuses and any(400 <= s < 500 for s in statuses), statuses
    out = server.client().completions.create(model="tiny", prompt="still here", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
