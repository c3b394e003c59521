"""Adapters loaded on first use (vLLM's filesystem resolver, VLLM_LORA_RESOLVER_CACHE_DIR /
--lora-resolver-dir) and vLLM's error shapes on the load and unload routes: a real
`batchpilot serve` on the tiny random Llama, PEFT-made adapters in a directory, the
official openai client; names that try to leave the directory are unknown models."""

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest

from batchpilot.server.lora.resolver import MAX_NAME_CHARS, find_adapter
from tests.support.models import make_adapter, make_tiny_llama, peft_greedy
from tests.support.servers import TINY_FLAGS, ServerProcess

MODEL = "tiny-llama"
ADMIN_TOKEN = "admin-token-resolver-81c2"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = [1000 + 37 * i for i in range(12)]


def unknown(name: str) -> dict:
    """vLLM's body for an unknown model, word for word."""
    return {"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError",
                      "param": "model", "code": 404}}  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """root/base (the model), root/adapters (the resolver's directory) and root/outside (an
    adapter no name may reach), with links that try to leave the directory."""
    root = tmp_path_factory.mktemp("resolver")
    base = make_tiny_llama(root / "base")
    adapters, outside = root / "adapters", root / "outside"
    adapters.mkdir()
    for seed, name in enumerate(("sql", "chat", "third"), start=1):
        make_adapter(base, adapters / name, seed=seed)
    make_adapter(base, outside / "secret", seed=9)
    make_adapter(base, outside / "static", seed=8)
    corrupt = adapters / "corrupt"
    shutil.copytree(adapters / "sql", corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage, not safetensors")
    (adapters / "escape").symlink_to(outside / "secret", target_is_directory=True)
    leaky = adapters / "leaky"  # a real directory whose files point outside
    leaky.mkdir()
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        (leaky / file).symlink_to(outside / "secret" / file)
    (adapters / "sibling").symlink_to(adapters / "chat", target_is_directory=True)
    (adapters / "empty").mkdir()
    return {"root": root, "base": Path(base), "adapters": adapters, "outside": outside}


@pytest.fixture(scope="module")
def server(tree, tmp_path_factory):
    """The directory comes from vLLM's variable; three adapters fit in host memory
    (--max-cpu-loras): the static one and two the resolver loads; more are read again."""
    args = ["--model", str(tree["base"]), "--served-model-name", MODEL, *TINY_FLAGS,
            "--admin-token", ADMIN_TOKEN, "--max-loras", "2", "--max-cpu-loras", "3",
            "--lora-modules", f"static={tree['outside'] / 'static'}"]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("server") / "serve.log")
    os.environ["VLLM_LORA_RESOLVER_CACHE_DIR"] = str(tree["adapters"])
    try:
        proc.start()
    finally:
        del os.environ["VLLM_LORA_RESOLVER_CACHE_DIR"]
    yield proc
    proc.stop()


def admin_post(server, route: str, body) -> httpx.Response:
    return httpx.post(f"{server.admin_url}/v1/{route}", json=body, headers=ADMIN, timeout=60)


def greedy(server, model: str, max_tokens: int = 6) -> list[str]:
    """The official client's greedy tokens (as logprobs name them) for `model`."""
    out = server.client().completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.model == model
    return out.choices[0].logprobs.tokens


def peft_tokens(tree, adapter: str) -> list[str]:
    """transformers + PEFT's 6 greedy tokens with adapters/<adapter>, named as above."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tree["base"])
    ids = peft_greedy(str(tree["base"]), str(tree["adapters"] / adapter), PROMPT, 6)
    return [tokenizer.decode([t]) for t in ids]


def model_ids(server) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]


def test_find_adapter_keeps_every_name_inside_the_directory(tree):
    adapters = tree["adapters"]
    assert find_adapter(str(adapters), "sql") == adapters / "sql"
    assert find_adapter(str(adapters), "sibling") == adapters / "chat"  # a link within
    refused = ["../outside/secret", "..", ".", "", "/etc", str(tree["outside"] / "secret"),
               "escape", "leaky", "empty", "missing", "sql/", "sql/../chat", "sql\x00",
               ".hidden", "-sql", "a b", "x" * (MAX_NAME_CHARS + 1), "x" * 100_000]  # fmt: skip
    for name in refused:
        assert find_adapter(str(adapters), name) is None, name
    assert find_adapter(str(tree["root"] / "no-such-dir"), "sql") is None


def test_an_adapter_of_the_directory_serves_from_its_first_request(server, tree):
    """The official client names it in `model`; the tokens are PEFT's for that adapter."""
    assert "sql" not in model_ids(server)
    assert greedy(server, "sql") == peft_tokens(tree, "sql")
    models = httpx.get(f"{server.url}/v1/models", timeout=10)
    cards = {m["id"]: (m["root"], m["parent"]) for m in models.json()["data"]}
    assert cards == {MODEL: (MODEL, None), "static": ("static", MODEL), "sql": ("sql", MODEL)}
    # No directory of the server's reaches a client.
    assert str(tree["root"]) not in models.text and "/adapters" not in models.text
    # The operator's list (admin port) holds only what it loads itself: it unloads what it
    # lists and its spec does not name.
    listed = httpx.get(f"{server.admin_url}/admin/lora_adapters", headers=ADMIN, timeout=10)
    assert [a["id"] for a in listed.json()["data"]] == ["static"]


def test_an_adapter_that_cannot_load_is_a_400_that_names_no_path(server, tree):
    """Refused by the engine's checks (with a slot free: static and sql are loaded)."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "corrupt", "prompt": PROMPT, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {
        "message": "LoRA adapter 'corrupt' was found but could not be loaded.",
        "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip
    assert "LoRA adapter corrupt from" in server.log()  # the reason, with its path, is logged


def test_first_requests_racing_load_it_once(server):
    errors: list[BaseException] = []

    def ask():
        try:
            greedy(server, "chat", max_tokens=2)
        except BaseException as e:  # reported below, once all have run
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert server.log().count("loaded LoRA adapter chat from") == 1
    assert model_ids(server) == [MODEL, "static", "sql", "chat"]


def test_names_that_leave_the_directory_are_unknown_models(server, tree):
    names = ["../outside/secret", str(tree["outside"] / "secret"), "escape", "leaky", "empty",
             "sql/../chat", "..", "missing", "x" * 1000, "%2e%2e%2foutside%2fsecret"]  # fmt: skip
    before = model_ids(server)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name in names:
            for route in ("/v1/completions", "/v1/chat/completions"):
                body = {"model": name, "prompt": "hi", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
                r = http.post(route, json=body)
                assert r.status_code == 404 and r.json() == unknown(name), (name, r.text)
        r = http.post("/tokenize", json={"model": "escape", "prompt": "hi"})
        assert r.status_code == 404 and r.json() == unknown("escape")
    with pytest.raises(openai.NotFoundError) as failed:
        server.client().completions.create(model="../outside/secret", prompt="hi", max_tokens=1)
    assert failed.value.body["type"] == "NotFoundError"
    assert model_ids(server) == before  # nothing loaded


def test_load_and_unload_errors_are_vllms(server, tree):
    def error(r: httpx.Response, status: int, type_: str, message: str) -> None:
        assert r.status_code == status, r.text
        assert r.json() == {"error": {"message": message, "type": type_, "param": None,
                                      "code": status}}  # fmt: skip

    both = "Both 'lora_name' and 'lora_path' must be provided."
    for body in ({}, {"lora_name": "x"}, {"lora_path": "/p"}, {"lora_name": "", "lora_path": ""}):
        error(admin_post(server, "load_lora_adapter", body), 400, "InvalidUserInput", both)
    path = str(tree["adapters"] / "sql")
    for name in ("static", "sql"):  # loaded at start, and by the resolver
        error(admin_post(server, "load_lora_adapter", {"lora_name": name, "lora_path": path}),
              400, "InvalidUserInput", f"The lora adapter '{name}' has already been loaded.")  # fmt: skip
    missing = str(tree["root"] / "missing")
    error(admin_post(server, "load_lora_adapter", {"lora_name": "x", "lora_path": missing}),
          404, "NotFoundError", f"Loading lora x failed: No adapter found for {missing}")  # fmt: skip
    corrupt = {"lora_name": "x", "lora_path": str(tree["adapters"] / "corrupt")}
    r = admin_post(server, "load_lora_adapter", corrupt)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
    for body in ({}, {"lora_name": ""}, {"lora_name": None}):
        error(admin_post(server, "unload_lora_adapter", body), 400, "InvalidUserInput",
              "'lora_name' needs to be provided to unload a LoRA adapter.")  # fmt: skip
    error(admin_post(server, "unload_lora_adapter", {"lora_name": "nope"}), 404,
          "NotFoundError", "The lora adapter 'nope' cannot be found.")  # fmt: skip
    huge = admin_post(server, "unload_lora_adapter", {"lora_name": "x" * 10_000})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "lora_name"


def test_adapters_past_max_cpu_loras_serve_and_an_unloaded_one_loads_again(server, tree):
    """static, sql and chat fill --max-cpu-loras 3: a fourth still serves, evicting the least
    recently used, which serves again when asked for (read again); all four are listed. An
    unloaded resolver adapter loads again on its next request."""
    assert set(model_ids(server)) >= {"static", "sql", "chat"}
    assert greedy(server, "third") == peft_tokens(tree, "third")
    assert greedy(server, "sql") == peft_tokens(tree, "sql")
    assert greedy(server, "chat") == peft_tokens(tree, "chat")
    assert set(model_ids(server)) >= {"static", "sql", "chat", "third"}
    r = admin_post(server, "unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully."
    assert "chat" not in model_ids(server)
    greedy(server, "chat", max_tokens=1)  # loads again
    assert server.log().count("loaded LoRA adapter chat from") == 2


def test_a_resolver_dir_that_is_not_a_directory_fails_the_start(tree, tmp_path):
    args = ["--model", str(tree["base"]), *TINY_FLAGS,
            "--lora-resolver-dir", str(tmp_path / "nowhere")]  # fmt: skip
    with pytest.raises(RuntimeError, match="server exited 2") as failed:
        ServerProcess(args, tmp_path / "serve.log").start()
    assert "is not a directory" in str(failed.value)


def test_the_flag_serves_the_directory_too(tree, tmp_path):
    """--lora-resolver-dir, without the variable; it turns LoRA on by itself."""
    args = ["--model", str(tree["base"]), "--served-model-name", MODEL, *TINY_FLAGS,
            "--lora-resolver-dir", str(tree["adapters"])]  # fmt: skip
    proc = ServerProcess(args, tmp_path / "serve.log").start()
    try:
        assert json.loads(httpx.get(f"{proc.url}/v1/models", timeout=10).text)["data"][1:] == []
        assert len(greedy(proc, "sibling", max_tokens=2)) == 2  # a link within the directory
        assert model_ids(proc) == [MODEL, "sibling"]
    finally:
        proc.stop()
