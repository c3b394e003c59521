"""LoRA adapters through the real control plane: the API server refuses bad spec.adapters
(the CRD's patterns and CEL), and the operator (kopf.testing.KopfRunner) loads and unloads
PEFT adapters made here into a real `batchpilot serve` process on 127.0.0.1 standing for
the service's one pod (its URL metrics source, as in test_operator_loop_cluster.py): an
adapter added to the spec becomes servable without a restart (same process, same
Deployment generation), one removed is unloaded, and status.adapters says so."""

from __future__ import annotations

import httpx
import pytest
from kubernetes import client

from tests.support.cluster import LOOP_TIMEOUT, loop_operator, not_found, server, start
from tests.support.models import make_adapter
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def adapters(tiny_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_adapter(tiny_path, root / n, seed=i) for i, n in enumerate(("sql", "chat"))}


@pytest.mark.parametrize(
    "adapters_spec, message",
    [
        ([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}], "each name may appear"),
        ([{"name": "tiny", "source": "/x"}], "named like the model"),
        ([{"name": "a", "source": "bundled"}], "source"),
        ([{"name": "a/b", "source": "/x"}], "name"),
    ],
)
def test_the_api_server_refuses_bad_adapters(api, adapters_spec, message):
    spec = {"model": {"source": "/m", "name": "tiny"}, "adapters": adapters_spec}
    with pytest.raises(client.ApiException) as e:
        api.create("bad", spec)
    assert e.value.status == 422 and message in e.value.body, e.value.body


def served(srv, api, name: str = "lora") -> dict[str, str]:
    """Adapter -> path, as the server lists them to the operator (its admin port)."""
    headers = {"Authorization": f"Bearer {api.derived_token(name)}"}
    answer = httpx.get(srv.admin_url + "/admin/lora_adapters", headers=headers, timeout=10)
    return {m["id"]: m["root"] for m in answer.json()["data"] if m.get("parent")}


def completes(srv, model: str) -> bool:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200


def states(api, name: str) -> dict[str, list[str]]:
    entries = api.get(name).get("status", {}).get("adapters") or []
    return {a["name"]: [r["state"] for r in a["replicas"]] for a in entries}


def until_states(api, name: str, want: dict[str, list[str]]) -> None:
    """Wait for status.adapters to show ``want``; a timeout says what it showed."""
    seen: list = []

    def check() -> bool:
        seen[:] = [api.get(name).get("status", {}).get("adapters")]
        return states(api, name) == want

    try:
        wait_for(f"status.adapters {want}", check, timeout=LOOP_TIMEOUT, not_yet=not_found)
    except AssertionError as e:
        raise AssertionError(f"{e}; status.adapters: {seen}") from None


def test_adapters_load_live_and_unload_without_a_restart(api, tiny_path, adapters, tmp_path):
    srv = server(tiny_path, tmp_path, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    spec = {
        "model": {"source": "/models/tiny", "name": "tiny"},
        "engine": {"maxLoras": 2, "maxLoraRank": 8},
        "adapters": [{"name": "sql", "source": adapters["sql"]}],
    }
    try:
        with loop_operator(api, [srv]):
            api.create("lora", spec)
            start(srv, api, "lora")
            wait_for("Ready", lambda: api.ready("lora"), timeout=LOOP_TIMEOUT, not_yet=not_found)
            until_states(api, "lora", {"sql": ["Loaded"]})
            assert served(srv, api) == {"sql": adapters["sql"]} and completes(srv, "sql")
            dep = api.apps.read_namespaced_deployment("lora", api.ns)
            args = dep.spec.template.spec.containers[0].args
            assert "--enable-lora" in args and not any("lora-modules" in a for a in args)
            generation, pid = dep.metadata.generation, srv.process.pid

            both = [*spec["adapters"], {"name": "chat", "source": adapters["chat"]}]
            api.patch("lora", {"adapters": both})
            wait_for(
                "chat served",
                lambda: "chat" in served(srv, api),
                timeout=LOOP_TIMEOUT,
                not_yet=not_found,
            )
            assert completes(srv, "chat")
            until_states(api, "lora", {"sql": ["Loaded"], "chat": ["Loaded"]})

            api.patch("lora", {"adapters": [{"name": "chat", "source": adapters["chat"]}]})
            wait_for(
                "sql unloaded",
                lambda: "sql" not in served(srv, api),
                timeout=LOOP_TIMEOUT,
                not_yet=not_found,
            )
            until_states(api, "lora", {"chat": ["Loaded"]})
            assert not completes(srv, "sql")

            dep = api.apps.read_namespaced_deployment("lora", api.ns)
            assert dep.metadata.generation == generation  # the pods never rolled
            assert srv.process.pid == pid and srv.process.poll() is None
    finally:
        srv.stop()
