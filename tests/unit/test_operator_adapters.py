"""Multi-LoRA on the operator's side: the schema, the pod template (adapters never roll it),
the adapter reconcile (plan, the shell against fake replicas, status, Degraded), the admin
client against small HTTP replicas, and the MaxLorasBottleneck law on synthetic windows."""

from __future__ import annotations

import argparse
import asyncio
import socket
from dataclasses import replace

import pytest
from aiohttp import web

from batchpilot import names
from batchpilot.operator import status as st
from batchpilot.operator.adapters import (
    FAILED,
    LOADED,
    LOADING,
    RETRY_FAILED_SECONDS,
    UNLOADING,
    AdapterSync,
    Memory,
    events,
    plan_replica,
)
from batchpilot.operator.children.config_map import LORA_MODULES_KEY, build_config_map
from batchpilot.operator.children.deployment import build_deployment
from batchpilot.operator.children.engine_args import read_engine_settings
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.plan import effective_engine, plan_adapters
from batchpilot.operator.children.pod import spec_problems
from batchpilot.operator.crd.spec import SpecError, parse_spec
from batchpilot.operator.loop.admin_client import (
    ADAPTERS_PATH,
    LOAD_PATH,
    UNLOAD_PATH,
    AdapterRefused,
    AdminClient,
    AdminError,
)
from batchpilot.operator.loop.observe import merge_windows, parse_metrics, replica_window
from batchpilot.operator.loop.scrape import Replica
from batchpilot.operator.loop.state import LoopState, TunerState
from batchpilot.operator.loop.tune import View, decide_tuning
from batchpilot.operator.loop.tuner_state import EngineSettings, TuneDecision
from batchpilot.operator.loop.turn import tuning_event
from tests.support.loop import tw

OWNER = Owner("chat", "ns", "uid-1")
TOKEN = "secret"


def spec_with(adapters: list[dict], **extra) -> dict:
    return {"model": {"source": "pvc://models/base", "name": "base"}, "adapters": adapters, **extra}


def template(spec: dict) -> dict:
    dep = build_deployment(OWNER, parse_spec(spec), image="img", admin_token=TOKEN)
    return dep["spec"]["template"]


def args_of(spec: dict) -> list[str]:
    return template(spec)["spec"]["containers"][0]["args"]


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    "adapters, problem",
    [
        (
            [{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}],
            "each name may appear once",
        ),
        ([{"name": "base", "source": "/x"}], "named like the model"),
        ([{"name": "a", "source": "bundled"}], "source"),
        ([{"name": "a", "source": "relative/path"}], "source"),
        ([{"name": "-a", "source": "/x"}], "name"),
        ([{"name": "a" * 64, "source": "/x"}], "name"),
        ([{"name": f"a{i}", "source": "/x"} for i in range(33)], "adapters"),
    ],
)
def test_the_schema_refuses_bad_adapters(adapters, problem):
    with pytest.raises(SpecError, match=problem):
        parse_spec(spec_with(adapters))


def test_the_schema_takes_every_source_form_and_lora_bounds():
    spec = parse_spec(
        spec_with(
            [
                {"name": "sql", "source": "/adapters/sql"},
                {"name": "org.chat_v2", "source": "hf://org/chat-lora"},
                {"name": "p", "source": "pvc://loras/p"},
            ],
            engine={"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8},
            tuning={"enabled": True, "maxLoras": {"min": 2, "max": 16}},
        )
    )
    assert [a.name for a in spec.adapters] == ["sql", "org.chat_v2", "p"]
    for bad in (
        {"engine": {"maxLoras": 4, "maxCpuLoras": 2}},
        {"engine": {"maxLoraRank": 12}},
        {"tuning": {"maxLoras": {"min": 2, "max": 8}}},  # engine.maxLoras 1 outside it
        {"engine": {"extraArgs": ["--lora-modules", "x=/y"]}},
        {"engine": {"extraArgs": ["--enable-lora"]}},
    ):
        with pytest.raises(SpecError):
            parse_spec(spec_with([], **bad))


# --------------------------------------------------------------------------- rendering


def test_adapters_turn_lora_on_in_the_template_but_are_never_flags():
    args = args_of(spec_with([{"name": "sql", "source": "/adapters/sql"}], engine={"maxLoras": 4}))
    assert "--enable-lora" in args
    assert args[args.index("--max-loras") + 1] == "4"
    assert args[args.index("--max-lora-rank") + 1] == "16"
    assert "--max-cpu-loras" not in args  # unset: the server's default
    assert not any(a.startswith("--lora-modules") for a in args)


def test_without_adapters_the_template_has_no_lora_flag():
    args = args_of(spec_with([]))
    assert not any("lora" in a for a in args)
    assert "--enable-lora" in args_of(spec_with([], engine={"enableLora": True}))


def test_adding_removing_and_moving_adapters_under_mounted_volumes_rolls_nothing():
    base = template(spec_with([{"name": "a", "source": "/adapters/a"}]))
    for adapters in (
        [{"name": "a", "source": "/adapters/a"}, {"name": "b", "source": "hf://org/b"}],
        [{"name": "b", "source": "pvc://models/loras/b"}],  # the model's claim: mounted
        [{"name": "a", "source": "/elsewhere/a"}],
    ):
        assert template(spec_with(adapters)) == base, adapters
    assert template(spec_with([], engine={"enableLora": True})) == base


def test_adapter_claims_are_mounted_read_only_once_beside_the_models():
    adapters = [
        {"name": "a", "source": "pvc://loras/a"},
        {"name": "b", "source": "pvc://loras/sub/b"},
        {"name": "c", "source": "pvc://models/c"},
    ]
    pod = template(spec_with(adapters))["spec"]
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [
        {"claimName": "models", "readOnly": True},
        {"claimName": "loras", "readOnly": True},
    ]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/models/loras"]["readOnly"] is True
    plans = plan_adapters(parse_spec(spec_with(adapters)))
    assert [(p.path, p.pvc) for p in plans] == [
        ("/models/loras/a", "loras"),
        ("/models/loras/sub/b", "loras"),
        ("/models/models/c", "models"),
    ]
    escape = plan_adapters(parse_spec(spec_with([{"name": "x", "source": "pvc://l/../../etc"}])))
    assert escape[0].path == "/models/l"


def test_hf_adapters_run_offline_and_the_engine_records_lora_settings():
    spec = spec_with([{"name": "a", "source": "hf://org/a"}], engine={"maxLoras": 2})
    env = {e["name"]: e.get("value") for e in template(spec)["spec"]["containers"][0]["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    dep = build_deployment(OWNER, parse_spec(spec), image="img", admin_token=TOKEN)
    assert read_engine_settings(dep)["maxLoras"] == 2


def test_a_tuned_max_loras_reaches_the_template_within_bounds():
    spec = parse_spec(
        spec_with(
            [{"name": "a", "source": "/a"}],
            engine={"maxLoras": 2},
            tuning={"enabled": True, "maxLoras": {"min": 1, "max": 8}},
        )
    )
    for tuned, want in ((4, "4"), (64, "8")):
        dep = build_deployment(
            OWNER, spec, image="img", admin_token=TOKEN, loops=LoopState(max_loras=tuned)
        )
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-loras") + 1] == want


def test_the_servers_own_cli_parses_the_lora_flags():
    from batchpilot.server.api.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_with([{"name": "a", "source": "/a"}], engine={"maxLoras": 3, "maxCpuLoras": 5})
    parsed = parser.parse_args(args_of(spec))
    assert parsed.enable_lora and parsed.max_loras == 3 and parsed.max_lora_rank == 16
    assert parsed.max_cpu_loras == 5


def test_new_replicas_start_with_the_adapters_the_config_map_lists(monkeypatch):
    """The ConfigMap carries the list, the container reads it as a variable, and the
    server's own CLI takes it from there (what Kubernetes does between them: put the key's
    value in the environment)."""
    from batchpilot.server.api.cli import add_arguments
    from batchpilot.server.api.lora_modules import LoRAModule

    adapters = [{"name": "a", "source": "/adapters/a"}, {"name": "b", "source": "pvc://loras/b"}]
    spec = parse_spec(spec_with(adapters))
    config_map = build_config_map(OWNER, spec, effective_engine(spec, LoopState()))
    env = {e["name"]: e for e in template(spec_with(adapters))["spec"]["containers"][0]["env"]}
    ref = env[names.LORA_MODULES_ENV]["valueFrom"]["configMapKeyRef"]
    assert ref == {"name": config_map["metadata"]["name"], "key": LORA_MODULES_KEY,
                   "optional": True}  # fmt: skip
    monkeypatch.setenv(names.LORA_MODULES_ENV, config_map["data"][ref["key"]])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(args_of(spec_with(adapters)))
    assert parsed.preload_lora_modules == [
        LoRAModule("a", "/adapters/a"),
        LoRAModule("b", "/models/loras/b"),
    ]
    # Without adapters or LoRA: neither the key nor the variable.
    plain = parse_spec(spec_with([]))
    assert LORA_MODULES_KEY not in build_config_map(OWNER, plain, plain.engine)["data"]
    env = template(spec_with([]))["spec"]["containers"][0]["env"]
    assert names.LORA_MODULES_ENV not in {e["name"] for e in env}


def test_the_adapter_variable_is_the_operators():
    spec = parse_spec(spec_with([], pod={"env": [{"name": names.LORA_MODULES_ENV, "value": "[]"}]}))
    assert spec_problems(spec) == [f"spec.pod.env: {names.LORA_MODULES_ENV} is set by the operator"]


# --------------------------------------------------------------------------- the plan

NOW = 10_000.0


def memory(entries: dict[str, tuple[str, dict[str, tuple[str, float]]]]) -> Memory:
    status = {
        "adapters": [
            {
                "name": name,
                "path": path,
                "replicas": [
                    {"pod": p, "state": s, "time": f"1970-01-01T02:{int(t) // 60 % 60:02d}:00Z"}
                    for p, (s, t) in pods.items()
                ],
            }
            for name, (path, pods) in entries.items()
        ]
    }
    return Memory.from_status(status)


def test_plan_loads_what_is_missing_and_unloads_what_the_spec_dropped():
    plan = plan_replica({"a": "/a", "b": "/b"}, {"a": "/a", "old": "/o"}, Memory(), "p0", NOW)
    assert plan.unload == ("old",) and plan.load == (("b", "/b"),)


def test_plan_reloads_an_adapter_whose_source_changed():
    plan = plan_replica({"a": "/new"}, {"a": "/old"}, Memory(), "p0", NOW)
    assert plan.unload == ("a",) and plan.load == (("a", "/new"),)


def test_plan_without_a_listing_loads_every_adapter_and_unloads_the_remembered():
    mem = memory({"a": ("/a", {"p0": (LOADED, 0)}), "gone": ("/g", {"p0": (LOADED, 0)})})
    plan = plan_replica({"a": "/a"}, None, mem, "p0", NOW)
    assert plan.load == (("a", "/a"),) and plan.unload == ("gone",)


def test_a_refused_adapter_waits_before_it_is_asked_again():
    failed_at = 7200.0  # 02:00
    mem = memory({"a": ("/a", {"p0": (FAILED, failed_at)})})
    early = plan_replica({"a": "/a"}, {}, mem, "p0", failed_at + 60)
    assert early.load == () and early.held["a"].state == FAILED
    late = plan_replica({"a": "/a"}, {}, mem, "p0", failed_at + RETRY_FAILED_SECONDS + 1)
    assert late.load == (("a", "/a"),)
    assert plan_replica({"a": "/fixed"}, {}, mem, "p0", failed_at + 60).load == (("a", "/fixed"),)
    assert plan_replica({"a": "/a"}, {}, mem, "p1", failed_at + 60).load == (("a", "/a"),)


# --------------------------------------------------------------------------- the shell


class FakeReplicas:
    """Replicas as the admin client sees them: loaded sets, and what each refuses."""

    def __init__(self, pods: list[str], listable: bool = True):
        self.loaded: dict[str, dict[str, str]] = {p: {} for p in pods}
        self.refuse_load: dict[str, str] = {}  # adapter -> message (400)
        self.busy: set[str] = set()  # adapters with requests in flight (unload 400)
        self.down: set[str] = set()
        self.listable = listable
        self.calls: list[tuple] = []

    async def replicas(self, namespace, name):
        return [Replica(p, f"http://{p}", f"http://{p}:8001") for p in self.loaded]

    async def list_adapters(self, admin_url, token):
        pod = admin_url.removeprefix("http://").removesuffix(":8001")
        return dict(self.loaded[pod]) if self.listable and pod not in self.down else None

    def _pod(self, admin_url: str) -> str:
        pod = admin_url.removeprefix("http://").removesuffix(":8001")
        if pod in self.down:
            raise AdminError("connection refused")
        return pod

    async def load_adapter(self, url, token, name, path):
        pod = self._pod(url)
        self.calls.append(("load", pod, name))
        if name in self.refuse_load:
            raise AdapterRefused(400, self.refuse_load[name])
        self.loaded[pod].setdefault(name, path)

    async def unload_adapter(self, url, token, name):
        pod = self._pod(url)
        self.calls.append(("unload", pod, name))
        if name in self.busy:
            raise AdapterRefused(400, f"requests for {name} are in flight")
        self.loaded[pod].pop(name, None)


def sync_turn(fake: FakeReplicas, adapters: list[dict], status: dict, now=NOW):
    sync = AdapterSync(fake, fake, clock=lambda: now)  # type: ignore[arg-type]
    spec = parse_spec(spec_with(adapters))
    out = asyncio.run(sync.run_once("ns", "chat", spec, status, TOKEN))
    return out, {"adapters": out.adapters} if out.adapters else {}


def states(status: dict) -> dict[str, dict[str, str]]:
    return {a["name"]: {x["pod"]: x["state"] for x in a["replicas"]} for a in status["adapters"]}


def test_adapters_load_on_every_replica_and_unload_when_removed():
    fake = FakeReplicas(["p0", "p1"])
    out, status = sync_turn(fake, [{"name": "a", "source": "/a"}], {})
    assert fake.loaded == {"p0": {"a": "/a"}, "p1": {"a": "/a"}}
    assert states(status) == {"a": {"p0": LOADED, "p1": LOADED}}
    assert status["adapters"][0]["loaded"] == 2
    assert [e[0] for e in out.events] == ["AdapterLoaded"]
    again, status = sync_turn(fake, [{"name": "a", "source": "/a"}], status)
    assert again.events == [] and len(fake.calls) == 2  # listed loaded: nothing sent
    gone, status = sync_turn(fake, [], status)
    assert fake.loaded == {"p0": {}, "p1": {}} and status == {}
    assert [e[0] for e in gone.events] == ["AdapterUnloaded"]


def test_a_new_replica_gets_the_adapters_the_turn_it_is_seen():
    fake = FakeReplicas(["p0"])
    _, status = sync_turn(fake, [{"name": "a", "source": "/a"}], {})
    fake.loaded["p1"] = {}
    _, status = sync_turn(fake, [{"name": "a", "source": "/a"}], status)
    assert fake.loaded["p1"] == {"a": "/a"} and status["adapters"][0]["loaded"] == 2


def test_a_refused_load_is_failed_with_the_servers_message_and_degrades():
    fake = FakeReplicas(["p0"])
    fake.refuse_load["bad"] = "adapter rank 64 exceeds max_lora_rank 16"
    _, status = sync_turn(fake, [{"name": "bad", "source": "/bad"}], {})
    (replica,) = status["adapters"][0]["replicas"]
    assert replica["state"] == FAILED and "max_lora_rank 16" in replica["message"]
    ok, reason, message = st.degraded(None, None, st.adapter_failures(status))
    assert ok and reason == st.ADAPTER_FAILED and "bad on p0" in message
    sync_turn(fake, [{"name": "bad", "source": "/bad"}], status, now=NOW + 30)
    assert fake.calls.count(("load", "p0", "bad")) == 1  # not asked again yet


def test_an_unreachable_replica_is_loading_and_a_busy_unload_is_unloading():
    fake = FakeReplicas(["p0", "p1"])
    _, status = sync_turn(fake, [{"name": "a", "source": "/a"}], {})
    fake.down.add("p1")
    fake.busy.add("a")
    _, status = sync_turn(fake, [{"name": "b", "source": "/b"}], status)
    assert states(status) == {
        "b": {"p0": LOADED, "p1": LOADING},
        "a": {"p0": UNLOADING, "p1": UNLOADING},  # in flight; unreachable: both retried
    }
    assert st.adapter_failures(status) is None
    fake.busy.clear()
    fake.down.clear()
    _, status = sync_turn(fake, [{"name": "b", "source": "/b"}], status)
    assert states(status) == {"b": {"p0": LOADED, "p1": LOADED}}
    assert fake.loaded == {"p0": {"b": "/b"}, "p1": {"b": "/b"}}


def test_without_a_listing_loads_are_repeated_and_removals_unloaded_by_memory():
    fake = FakeReplicas(["p0"], listable=False)
    _, status = sync_turn(fake, [{"name": "a", "source": "/a"}], {})
    _, status = sync_turn(fake, [{"name": "a", "source": "/a"}], status)
    assert fake.calls == [("load", "p0", "a"), ("load", "p0", "a")]  # idempotent
    _, status = sync_turn(fake, [], status)
    assert fake.calls[-1] == ("unload", "p0", "a") and status == {}


def test_events_say_when_an_adapter_is_served_by_all_and_when_it_is_gone():
    half = [{"name": "a", "loaded": 1, "replicas": [{"pod": "p0"}, {"pod": "p1"}]}]
    full = [{"name": "a", "loaded": 2, "replicas": [{"pod": "p0"}, {"pod": "p1"}]}]
    assert [e[0] for e in events(half, full)] == ["AdapterLoaded"]
    assert events(full, full) == [] and events(full, half) == []
    assert [e[0] for e in events(full, [])] == ["AdapterUnloaded"]


# --------------------------------------------------------------------------- admin client


def lora_replica(loaded: dict[str, str]) -> web.Application:
    """vLLM's LoRA routes as the contract states them."""

    async def load(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        body = await request.json()
        name = body["lora_name"]
        if name in loaded:
            message = f"The lora adapter '{name}' has already been loaded."
            return web.json_response({"error": {"message": message}}, status=400)
        if "starting" in body["lora_path"]:
            return web.json_response({"error": {"message": "still loading"}}, status=503)
        if "corrupt" in body["lora_path"]:
            return web.json_response({"error": {"message": "no adapter_config.json"}}, status=400)
        loaded[name] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if loaded.pop(name, None) is None:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.Response(text="Success")

    async def models(request: web.Request) -> web.Response:
        data = [{"id": "base", "root": "/m", "parent": None}]
        data += [{"id": n, "root": p, "parent": "base"} for n, p in loaded.items()]
        return web.json_response({"object": "list", "data": data})

    app = web.Application()
    app.router.add_post(LOAD_PATH, load)
    app.router.add_post(UNLOAD_PATH, unload)
    app.router.add_get(ADAPTERS_PATH, models)
    return app


async def _against_replica(loaded: dict[str, str], calls) -> list:
    runner = web.AppRunner(lora_replica(loaded))
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = AdminClient(timeout=5, adapter_timeout=5)
    out = []
    try:
        for call in calls:
            try:
                out.append(await call(client, url))
            except AdminError as e:
                out.append(e)
    finally:
        await runner.cleanup()
    return out


def test_admin_client_loads_idempotently_and_tells_refusals_apart():
    loaded: dict[str, str] = {}
    out = asyncio.run(
        _against_replica(
            loaded,
            [
                lambda c, u: c.load_adapter(u, TOKEN, "a", "/a"),
                lambda c, u: c.load_adapter(u, TOKEN, "a", "/a"),  # already loaded: fine
                lambda c, u: c.load_adapter(u, TOKEN, "b", "/corrupt"),
                lambda c, u: c.load_adapter(u, TOKEN, "c", "/starting"),
                lambda c, u: c.list_adapters(u, TOKEN),
                lambda c, u: c.unload_adapter(u, TOKEN, "a"),
                lambda c, u: c.unload_adapter(u, TOKEN, "a"),  # 404: already gone
            ],
        )
    )
    assert out[0] is None and out[1] is None
    assert isinstance(out[2], AdapterRefused) and out[2].status == 400
    assert out[2].message == "no adapter_config.json"
    assert isinstance(out[3], AdminError) and not isinstance(out[3], AdapterRefused)
    assert out[4] == {"a": "/a"}
    assert out[5] is None and out[6] is None and loaded == {}


def test_admin_client_unreachable_is_an_admin_error_and_no_listing_is_none():
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    client = AdminClient(timeout=2, adapter_timeout=2)
    with pytest.raises(AdminError) as e:
        asyncio.run(client.load_adapter(url, TOKEN, "a", "/a"))
    assert not isinstance(e.value, AdapterRefused)
    assert asyncio.run(client.list_adapters(url, TOKEN)) is None


# --------------------------------------------------------------------------- the law

LORA_TUNE = parse_spec(
    {
        "engine": {"maxNumSeqs": 8, "maxLoras": 2},
        "slo": {"interTokenLatencySeconds": 0.1},
        "tuning": {
            "enabled": True,
            "maxNumSeqs": {"min": 2, "max": 64},
            "maxLoras": {"min": 1, "max": 4},
        },
        "adapters": [{"name": "a", "source": "/a"}],
    }
)
AT2 = EngineSettings(8, "auto", max_loras=2)


def lora_window(share: float, max_loras: int = 2):
    """Half the batch slots busy, requests waiting for adapters ``share`` of the time."""
    w = tw(running=4, waiting=3, tokens=100)
    return replace(w, lora_bottleneck=share, max_loras=dict.fromkeys(w.max_num_seqs, max_loras))


def decide(w, settings=AT2, spec=LORA_TUNE):
    view = View(service=w, replicas={"http://r0": w})
    return decide_tuning(view, spec, TunerState(settings=settings), settings, 1000.0)


def test_max_loras_bottleneck_raises_max_loras_at_once_and_rolls():
    """A raise of max_loras is a guardrail move (the safe direction): applied, no test."""
    d, state = decide(lora_window(0.8))
    assert d.action == "guard" and d.kind == "raise_loras" and state.experiment is None
    assert state.settings == replace(AT2, max_loras=4)
    assert d.reason.startswith("guardrail: MaxLorasBottleneck")
    assert tuning_event(d, "")[0] == "MaxLorasBottleneck"
    assert LoopState(max_loras=4).max_loras == 4


def test_a_rare_bottleneck_or_no_tuning_range_changes_nothing():
    _, state = decide(lora_window(0.2))
    assert state.experiment is None
    untuned = LORA_TUNE.model_copy(
        update={"tuning": LORA_TUNE.tuning.model_copy(update={"max_loras": None})}
    )
    _, state = decide(lora_window(0.9), settings=EngineSettings(8), spec=untuned)
    assert state.experiment is None


def test_at_the_bound_the_tuner_holds_says_why_once_and_leaves_it_to_the_scaler():
    at4 = replace(AT2, max_loras=4)
    d, state = decide(lora_window(0.9, max_loras=4), settings=at4)
    assert state.experiment is None and d.action == "hold"
    assert d.reason.startswith("MaxLorasBottleneck") and "autoscaler" in d.reason
    assert tuning_event(d, "no rule applies: holding") == ("MaxLorasBottleneck", d.reason)
    assert tuning_event(d, d.reason) is None
    held = TuneDecision("hold", at4, "no rule applies: holding")
    assert tuning_event(held, d.reason) is None


LORA_TEXT = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
# TYPE batchpilot:max_num_seqs gauge
batchpilot:max_num_seqs{{model_name="m"}} 8
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{run}",waiting_lora_adapters="{wait}"}} 2.0
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}} 1.0
"""


@pytest.mark.parametrize(
    "running, run, wait, bound",
    [
        (2, "a,b", "c", True),  # both slots taken, c waits, batch slots free
        (2, "a", "c", False),  # a LoRA slot is free: c is admitted next step
        (2, "a,b", "a", False),  # waits for an active adapter: not a LoRA limit
        (8, "a,b", "c", False),  # the batch is full: max_num_seqs' problem
    ],
)
def test_the_lora_metric_reads_as_a_bottleneck_only_when_slots_are_the_limit(
    running, run, wait, bound
):
    text = LORA_TEXT.format(running=running, run=run, wait=wait)
    samples = [parse_metrics(text, now=t) for t in (0.0, 15.0)]
    assert samples[0].lora.max_loras == 2  # the newest series (value 2.0) counts
    w = replica_window("http://r0", samples)
    assert w.lora_bottleneck == (1.0 if bound else 0.0) and w.max_loras == {"http://r0": 2}
    idle = replica_window(
        "http://r1", [parse_metrics(LORA_TEXT.format(running=0, run="", wait=""), 0)]
    )
    assert merge_windows([w, idle]).lora_bottleneck == (0.5 if bound else 0.0)


def test_an_unreadable_lora_family_loses_only_the_lora_reading():
    text = LORA_TEXT.format(running=1, run="a", wait="").replace('max_lora="2"', 'max_lora="x"')
    sample = parse_metrics(text, now=0.0)
    assert sample.lora is None and sample.gauges
