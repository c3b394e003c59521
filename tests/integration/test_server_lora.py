"""Multi-LoRA over HTTP, vLLM's interface: `batchpilot serve --lora-modules` on the tiny
random Llama with PEFT-made adapters; the adapter chosen by `model` gives transformers +
PEFT's greedy tokens, the admin port loads and unloads adapters, /v1/models lists them and
/metrics carries vllm:lora_requests_info."""

import argparse
import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot.server.api.lora_modules import LoRAModule, parse_lora_module, parse_lora_module_list
from tests.support.models import make_adapter, peft_greedy
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

MODEL = "tiny-llama"
ADMIN_TOKEN = "admin-token-lora-5d1e"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = [1000 + 37 * i for i in range(12)]  # token ids: no tokenizer differences
LORA_INFO = "vllm:lora_requests_info"


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    from tests.support.models import make_tiny_llama

    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "base")
    other = make_tiny_llama(root / "other", hidden_size=32, intermediate_size=64, head_dim=8)
    paths = {"base": base, "sql": make_adapter(base, root / "sql", seed=1),
             "chat": make_adapter(base, root / "chat", seed=2),
             "late": make_adapter(base, root / "late", seed=3),
             "mismatch": make_adapter(other, root / "mismatch", seed=4)}  # fmt: skip
    corrupt = root / "corrupt"
    shutil.copytree(paths["sql"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage, not safetensors")
    paths["corrupt"] = str(corrupt)
    return paths


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    chat = json.dumps({"name": "chat", "path": paths["chat"], "base_model_name": "tiny-base"})
    args = ["--model", paths["base"], "--served-model-name", MODEL, *TINY_FLAGS,
            "--admin-token", ADMIN_TOKEN, "--max-loras", "2", "--max-cpu-loras", "4",
            "--lora-modules", f"sql={paths['sql']}", chat]  # fmt: skip
    log = tmp_path_factory.mktemp("server") / "serve.log"
    proc = ServerProcess(args, log).start()
    yield proc
    proc.stop()


def complete(server, model: str, max_tokens: int = 8):
    return server.client().completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def tokens_of(out) -> list[str]:
    return out.choices[0].logprobs.tokens


@pytest.fixture(scope="module")
def expected(paths):
    """adapter name (or MODEL) -> PEFT's 8 greedy tokens as the server's logprobs name them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    cache = {}

    def tokens(model: str) -> list[str]:
        if model not in cache:
            adapter = None if model == MODEL else paths[model]
            ids = peft_greedy(paths["base"], adapter, PROMPT, 8)
            cache[model] = [tokenizer.decode([t]) for t in ids]
        return cache[model]

    return tokens


def lora_info(server) -> dict[str, str]:
    """The labels of the one vllm:lora_requests_info sample."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = [f for f in text_string_to_metric_families(text) if f.name == LORA_INFO]
    assert len(families) == 1 and len(families[0].samples) == 1, families
    return families[0].samples[0].labels


def admin_post(server, route: str, body, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.admin_url}/v1/{route}", json=body, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    return error["message"]


def test_lora_modules_flag_takes_both_vllm_spellings():
    assert parse_lora_module("sql=/a/b") == LoRAModule("sql", "/a/b")
    spec = '{"name": "org/x:v1", "path": "/p", "base_model_name": "base"}'
    assert parse_lora_module(spec) == LoRAModule("org/x:v1", "/p", "base")
    bad = ("sql", "=/p", "a,b=/p", "sql=", '{"name": "x"}', '{"name": 5, "path": "/p"}',
           '{"name": "x", "path": "/p", "base_model_name": 1}')  # fmt: skip
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(text)


def test_adapter_chosen_by_model_gives_peft_greedy_tokens(server, expected):
    for model in (MODEL, "sql", "chat"):
        out = complete(server, model)
        assert tokens_of(out) == expected(model), model
        assert out.model == model
    assert expected("sql") != expected(MODEL) != expected("chat"), "an adapter changed nothing"


def test_models_list_adapters_by_name_and_parent_never_their_paths(server, paths):
    """vLLM shows an adapter's directory as root; /v1/models is anyone's to read, so root
    is the adapter's name, as the served model's is."""
    r = httpx.get(f"{server.url}/v1/models")
    models = r.json()["data"]
    cards = {m["id"]: (m["root"], m["parent"], m["max_model_len"]) for m in models}
    assert [m["id"] for m in models] == [MODEL, "sql", "chat"]
    assert cards == {MODEL: (MODEL, None, 512), "sql": ("sql", MODEL, 512),
                     "chat": ("chat", "tiny-base", 512)}  # fmt: skip
    assert str(Path(paths["sql"]).parent) not in r.text


def test_unknown_model_and_unknown_adapter(server):
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        # vLLM's shape for an unknown model, word for word.
        assert r.status_code == 404 and r.json() == {"error": {
            "message": "The model `nope` does not exist.", "type": "NotFoundError",
            "param": "model", "code": 404}}  # fmt: skip
        # The runtime routes are the admin port's only.
        assert_error(http.post("/v1/load_lora_adapter", json={}), 404)
    message = assert_error(admin_post(server, "unload_lora_adapter", {"lora_name": "nope"}), 404)
    assert message == "The lora adapter 'nope' cannot be found."


def test_load_and_unload_over_the_admin_port(server, paths, expected):
    load = {"lora_name": "late", "lora_path": paths["late"]}
    assert_error(admin_post(server, "load_lora_adapter", load, headers={}), 401)
    bad = [{"lora_name": "x", "lora_path": paths["corrupt"]},
           {"lora_name": "x", "lora_path": paths["mismatch"]},
           {"lora_name": "a b", "lora_path": paths["late"]},
           {"lora_name": "sql", "lora_path": paths["late"]}]  # fmt: skip
    for body in bad:
        assert_error(admin_post(server, "load_lora_adapter", body), 400)
    # vLLM's 404 for a path that holds no adapter (test_server_lora_resolver.py has the
    # bodies word for word).
    missing = {"lora_name": "x", "lora_path": paths["late"] + "/missing"}
    assert_error(admin_post(server, "load_lora_adapter", missing), 404)
    r = admin_post(server, "load_lora_adapter", load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert tokens_of(complete(server, "late")) == expected("late")
    listed = httpx.get(f"{server.url}/v1/models")
    assert listed.json()["data"][-1]["root"] == "late" and paths["late"] not in listed.text
    # The operator's view, on the admin port behind the token, has the directories.
    adapters_url = f"{server.admin_url}/admin/lora_adapters"
    assert httpx.get(adapters_url, timeout=10).status_code == 401
    with_paths = httpx.get(adapters_url, headers=ADMIN, timeout=10).json()["data"]
    assert {a["id"]: a["root"] for a in with_paths}["late"] == paths["late"]
    # In use: the unload is refused until its requests are done.
    stream = threading.Thread(target=complete, args=(server, "late", 400))
    stream.start()
    wait_for(
        "the adapter late running",
        lambda: lora_info(server)["running_lora_adapters"] == "late",
        interval=0.05,
    )
    assert lora_info(server)["max_lora"] == "2"
    assert_error(admin_post(server, "unload_lora_adapter", {"lora_name": "late"}), 400)
    stream.join()
    r = admin_post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    assert_error(httpx.post(f"{server.url}/v1/completions",
                            json={"model": "late", "prompt": "hi"}), 404)  # fmt: skip
    assert lora_info(server) == {"max_lora": "2", "running_lora_adapters": "",
                                 "waiting_lora_adapters": ""}  # fmt: skip
    assert tokens_of(complete(server, MODEL)) == expected(MODEL)  # the base model unharmed


def test_a_bad_lora_module_fails_start_up_naming_it(paths, tmp_path):
    args = ["--model", paths["base"], *TINY_FLAGS, "--lora-modules",
            f"sql={paths['sql']}", f"broken={paths['mismatch']}"]  # fmt: skip
    with pytest.raises(RuntimeError, match="server exited 1") as failed:
        ServerProcess(args, tmp_path / "serve.log").start()
    assert f"broken={paths['mismatch']}" in str(failed.value)


def test_preloaded_adapters_that_cannot_load_are_left_out_and_the_rest_serve(
    paths, expected, tmp_path
):
    """--preload-lora-modules (the operator's $BATCHPILOT_LORA_MODULES): what loads is
    served from the first request on; a corrupt adapter and another base model's are
    logged and left out, and the server starts anyway."""
    modules = [{"name": "chat", "path": paths["chat"]},
               {"name": "corrupt", "path": paths["corrupt"]},
               {"name": "mismatch", "path": paths["mismatch"]},
               {"name": "gone", "path": str(tmp_path / "gone")}]  # fmt: skip
    args = ["--model", paths["base"], "--served-model-name", MODEL, *TINY_FLAGS,
            "--lora-modules", f"sql={paths['sql']}",
            "--preload-lora-modules", json.dumps(modules)]  # fmt: skip
    proc = ServerProcess(args, tmp_path / "serve.log").start()
    try:
        models = httpx.get(f"{proc.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL, "sql", "chat"]
        for model in ("sql", "chat"):
            assert tokens_of(complete(proc, model)) == expected(model), model
        for name in ("corrupt", "mismatch", "gone"):
            r = httpx.post(f"{proc.url}/v1/completions", timeout=60,
                           json={"model": name, "prompt": PROMPT, "max_tokens": 2})  # fmt: skip
            assert assert_error(r, 404) == f"The model `{name}` does not exist."
            assert f"LoRA adapter {name} from" in proc.log(), name
    finally:
        proc.stop()


def test_the_preload_list_is_a_bounded_json_list_of_vllm_modules():
    text = '[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b", "base_model_name": "m"}]'
    assert parse_lora_module_list(text) == [LoRAModule("a", "/a"), LoRAModule("b", "/b", "m")]
    assert parse_lora_module_list("") == []
    too_many = json.dumps([{"name": f"a{i}", "path": "/a"} for i in range(1025)])
    for bad in ("{", '{"name": "a", "path": "/a"}', '["a=/a"]', '[{"name": "-a", "path": "/a"}]',
                too_many):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module_list(bad)
