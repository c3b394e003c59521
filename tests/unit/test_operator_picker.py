"""The endpoint picker the operator deploys (spec.routing.endpointPicker.deploy): its
children as GIE v1.5.0's chart makes them (config, RBAC, probes, security, ownership), the
KV-cache events the precise scorer needs from the server pods, the CRD's rules, the
reconcile that builds and removes them, and the Degraded condition it reports."""

from __future__ import annotations

import json

import pytest
import yaml

from batchpilot.operator import rbac, status
from batchpilot.operator.children.build import build_children
from batchpilot.operator.children.meta import (
    LABEL_MANAGED_BY,
    MANAGED_BY,
    Owner,
    owner_reference,
    selector_labels,
)
from batchpilot.operator.children.picker import (
    GRPC_PORT,
    HEALTH_PORT,
    LEADER_ELECTION_RULES,
    PICKER_KINDS,
    PICKER_RULES,
    name_problem,
    picker_children,
)
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd.spec import SpecError, parse_spec
from batchpilot.operator.reconcile import Reconciler
from tests.support.fake_kube import KEY, NS, FakeKube, conds

OWNER = Owner(name="chat", namespace=NS, uid="uid-chat")
IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"


def routing(**picker) -> dict:
    return {"routing": {"inferencePool": True, "endpointPicker": {"image": IMAGE, **picker}}}


def objects(spec: dict) -> dict[str, dict]:
    """The picker's children by kind."""
    return {c["kind"]: c for c in picker_children(OWNER, parse_spec(spec))}


def config(spec: dict) -> dict:
    return yaml.safe_load(objects(spec)["ConfigMap"]["data"]["epp.yaml"])


def profile(spec: dict) -> list[tuple[str, float | None]]:
    (p,) = config(spec)["schedulingProfiles"]
    return [(ref["pluginRef"], ref.get("weight")) for ref in p["plugins"]]


def epp_container(spec: dict) -> dict:
    (c,) = objects(spec)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def server_container(spec: dict) -> dict:
    children = build_children(OWNER, parse_spec(spec), image="img", admin_token="t")
    (dep,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


# ---------------------------------------------------------------- the config


def test_the_default_profile_is_gies_default():
    cfg = config(routing())
    assert cfg["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert cfg["kind"] == "EndpointPickerConfig"
    # GIE's chart's weights (queue 2, KV-cache 2, prefix 3), then the max-score picker.
    assert profile(routing()) == [
        ("queue-scorer", 2),
        ("kv-cache-utilization-scorer", 2),
        ("prefix-cache-scorer", 3),
        ("max-score-picker", None),
    ]
    (prefix,) = [p for p in cfg["plugins"] if p["type"] == "prefix-cache-scorer"]
    # Sized from each pod's vllm:cache_config_info.
    assert prefix["parameters"] == {"autoTune": True, "maxPrefixBlocksToMatch": 256}
    assert [p["type"] for p in cfg["plugins"]] == [name for name, _ in profile(routing())]


def test_weights_are_the_specs_and_zero_leaves_a_scorer_out():
    scorers = {"queueWeight": 5, "kvCacheUtilizationWeight": 0, "prefixCache": {"weight": 1}}
    assert profile(routing(scorers=scorers)) == [
        ("queue-scorer", 5),
        ("prefix-cache-scorer", 1),
        ("max-score-picker", None),
    ]


def test_lora_affinity_only_while_lora_is_on():
    assert ("lora-affinity-scorer", 1) not in profile(routing())
    with_adapter = {**routing(), "adapters": [{"name": "sql", "source": "/adapters/sql"}]}
    assert ("lora-affinity-scorer", 1) in profile(with_adapter)
    assert ("lora-affinity-scorer", 1) in profile({**routing(), "engine": {"enableLora": True}})


def test_without_auto_tune_the_index_is_sized_from_the_engine():
    prefix = {"autoTune": False, "maxPrefixBlocks": 64, "lruCapacityPerServer": 5000}
    spec = {**routing(scorers={"prefixCache": prefix}), "engine": {"blockSize": 32}}
    (p,) = [p for p in config(spec)["plugins"] if p["type"] == "prefix-cache-scorer"]
    assert p["parameters"] == {
        "autoTune": False,
        "maxPrefixBlocksToMatch": 64,
        "blockSizeTokens": 32,
        "lruCapacityPerServer": 5000,
    }


PRECISE = routing(scorers={"prefixCache": {"mode": "precise"}})


def test_precise_prefix_subscribes_to_the_server_pods_events():
    (p,) = [p for p in config(PRECISE)["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    params = p["parameters"]
    assert params["tokenProcessorConfig"] == {"blockSize": 16}  # the engine's block size
    discovery = params["kvEventsConfig"]["podDiscoveryConfig"]
    selector = dict(term.split("=") for term in discovery["podLabelSelector"].split(","))
    assert selector == selector_labels("chat")  # exactly the server pods
    assert discovery["podNamespace"] == NS and discovery["socketPort"] == 5557
    assert params["kvEventsConfig"]["topicFilter"] == "kv@"


def test_precise_prefix_renders_the_servers_kv_events():
    c = server_container(PRECISE)
    flag = c["args"].index("--kv-events-config")
    events = json.loads(c["args"][flag + 1])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "kv@$(POD_IP):8000@smollm2-135m-instruct",
    }
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in c["ports"]
    (ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]  # Kubernetes expands $(POD_IP)
    assert ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for spec in (routing(), {}):  # the approximate scorer needs no events
        c = server_container(spec)
        assert "--kv-events-config" not in c["args"] and len(c["ports"]) == 2


def test_a_config_change_rolls_the_picker():
    def digest(spec):
        return objects(spec)["Deployment"]["spec"]["template"]["metadata"]["annotations"]

    assert digest(routing()) == digest(routing())
    assert digest(routing()) != digest(routing(scorers={"queueWeight": 1}))


# ---------------------------------------------------------------- the objects


def test_every_object_is_owned_and_labelled_as_the_picker():
    children = picker_children(OWNER, parse_spec(routing()))
    assert [(c["apiVersion"], c["kind"]) for c in children] == list(PICKER_KINDS)
    for c in children:
        meta = c["metadata"]
        assert meta["name"] == "chat-epp" and meta["namespace"] == NS
        assert meta["ownerReferences"] == [owner_reference(OWNER)]
        assert meta["labels"][LABEL_MANAGED_BY] == MANAGED_BY
    # Neither the server's Service nor its pool ever selects the picker's pods.
    pod_labels = objects(routing())["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not selector_labels("chat").items() <= pod_labels.items()


def test_nothing_unless_deployed():
    for spec in ({}, {"routing": {"inferencePool": True, "endpointPicker": {"name": "mine"}}}):
        assert picker_children(OWNER, parse_spec(spec)) == []


def test_the_pool_points_at_the_deployed_pickers_service():
    children = build_children(OWNER, parse_spec(routing(port=9102)), image="i", admin_token="t")
    (pool,) = [c for c in children if c["kind"] == "InferencePool"]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]) == ("chat-epp", {"number": 9102})
    svc = objects(routing(port=9102))["Service"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("grpc-ext-proc", 9102, "grpc"),
        ("http-metrics", 9090, "metrics"),
    ]
    assert objects(routing(name="router"))["Service"]["metadata"]["name"] == "router"


def test_the_role_grants_what_gies_chart_grants_and_nothing_more():
    objs = objects(routing())
    assert objs["Role"]["rules"] == PICKER_RULES
    granted = {(g, r, v) for rule in PICKER_RULES for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    assert granted == {
        *{("", "pods", v) for v in ("get", "list", "watch")},
        *{("inference.networking.k8s.io", "inferencepools", v) for v in ("get", "list", "watch")},
        *{("inference.networking.x-k8s.io", r, v)
          for r in ("inferenceobjectives", "inferencemodelrewrites")
          for v in ("get", "list", "watch")},
    }  # fmt: skip
    binding = objs["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "chat-epp",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-epp", "namespace": NS}]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-epp"


def test_the_operator_holds_every_right_it_grants():
    """RBAC's escalation check: a Role may grant only what its creator holds."""

    def covered(rule: dict) -> bool:
        return all(
            any(
                g in r["apiGroups"] and res in r["resources"] and v in r["verbs"]
                for r in rbac.RULES
            )
            for g in rule["apiGroups"]
            for res in rule["resources"]
            for v in rule["verbs"]
        )

    assert all(covered(rule) for rule in PICKER_RULES + LEADER_ELECTION_RULES)


def test_more_replicas_elect_a_leader():
    one, three = objects(routing()), objects(routing(replicas=3))
    assert "--ha-enable-leader-election" not in epp_container(routing())["args"]
    assert "--ha-enable-leader-election" in epp_container(routing(replicas=3))["args"]
    assert one["Role"]["rules"] == PICKER_RULES
    assert three["Role"]["rules"] == PICKER_RULES + LEADER_ELECTION_RULES
    probe = epp_container(routing(replicas=3))["readinessProbe"]["grpc"]
    assert probe == {"port": HEALTH_PORT, "service": "readiness"}
    assert three["Deployment"]["spec"]["replicas"] == 3
    assert three["Deployment"]["spec"]["strategy"] == {"type": "Recreate"}


def test_the_container_runs_gies_epp_restricted():
    c = epp_container(routing(verbosity=4))
    assert c["image"] == IMAGE
    assert {"--pool-name=chat", f"--pool-namespace={NS}", "--config-file=/config/epp.yaml",
            "--pool-group=inference.networking.k8s.io", "--v=4"} <= set(c["args"])  # fmt: skip
    assert c["ports"][0] == {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": HEALTH_PORT, "service": "inference-extension"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}}
    pod = objects(routing())["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "config", "configMap": {"name": "chat-epp"}} in pod["volumes"]


# ---------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    ("routing_spec", "message"),
    [
        ({"inferencePool": True, "endpointPicker": {"port": 9002}}, "name is required unless"),
        ({"inferencePool": True, "endpointPicker": {"deploy": True}}, "image is required"),
        ({"endpointPicker": {"image": IMAGE}}, "deploy needs routing.inferencePool"),
        ({"inferencePool": True, "endpointPicker": {"image": IMAGE, "name": "a.b"}}, "DNS-1035"),
        ({"inferencePool": True, "endpointPicker": {"image": IMAGE, "replicas": 4}}, "replicas"),
    ],
)
def test_the_spec_refuses(routing_spec, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"routing": routing_spec})


def test_a_user_run_picker_still_needs_only_its_name():
    spec = parse_spec({"routing": {"inferencePool": True, "endpointPicker": {"name": "e.p"}}})
    assert spec.routing.picker is None


def test_extra_args_may_not_set_kv_events_while_the_operator_renders_them():
    args = {"engine": {"extraArgs": ["--kv-events=x"]}}
    with pytest.raises(SpecError, match="kv-events-config"):
        parse_spec({**PRECISE, **args})
    parse_spec({**routing(), **args})  # approximate: the user's own indexer may read them
    parse_spec(args)


def test_a_picker_may_not_take_the_servers_names():
    for name in ("chat", "chat-engine"):
        spec = parse_spec(routing(name=name))
        assert "taken by the server" in name_problem(OWNER, spec.routing.picker)
    assert name_problem(OWNER, parse_spec(routing()).routing.picker) is None


# ---------------------------------------------------------------- the reconcile


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def rec(kube):
    # A Deployment's events refresh status at once here (no coalescing): test_operator_api_load
    # has the coalesced refresh.
    config = OperatorConfig(server_image="default/img:1", admin_key=KEY)
    return Reconciler(config, kube=kube, refresh_delay=0)


def picker_objects(kube: FakeKube) -> list[tuple[str, str]]:
    return sorted((k, n) for k, n in kube.children() if n == "chat-epp")


def test_reconcile_builds_the_picker_and_removes_it_when_turned_off(kube, rec):
    body = kube.add_isvc("chat", routing())
    rec.reconcile(body)
    assert picker_objects(kube) == sorted((kind, "chat-epp") for _, kind in PICKER_KINDS)
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")
    # Someone else's Service in the namespace, with the picker's labels, is never deleted.
    theirs = {**kube.objects[("Service", NS, "chat-epp")]}
    theirs["metadata"] = {**theirs["metadata"], "name": "other", "ownerReferences": []}
    kube.put(theirs)
    body = kube.add_isvc("chat", {"routing": {"inferencePool": True,
                                              "endpointPicker": {"name": "mine"}}}, 2)  # fmt: skip
    rec.reconcile(body)
    assert picker_objects(kube) == []
    assert ("Service", NS, "other") in kube.objects
    (pool,) = [o for (k, _, _), o in kube.objects.items() if k == "InferencePool"]
    assert pool["spec"]["endpointPickerRef"]["name"] == "mine"


def test_a_picker_that_cannot_run_degrades_the_service(kube, rec):
    body = kube.add_isvc("chat", routing())
    rec.reconcile(body)
    dep = kube.objects[("Deployment", NS, "chat-epp")]
    dep["status"] = {"conditions": [{"type": "Progressing", "status": "False",
                                     "reason": "ProgressDeadlineExceeded",
                                     "message": 'ReplicaSet "chat-epp-1" has timed out progressing.'}]}  # fmt: skip
    rec.on_deployment_event("MODIFIED", dep)
    degraded = status.find_condition(kube.status("chat"), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "EndpointPickerUnavailable")
    assert "chat-epp" in degraded["message"] and "timed out" in degraded["message"]
    # A server Deployment's event keeps it; the picker's recovery clears it.
    rec.on_deployment_event("MODIFIED", kube.objects[("Deployment", NS, "chat")])
    assert conds(kube.status("chat"))["Degraded"] == ("True", "EndpointPickerUnavailable")
    dep["status"] = {"conditions": [{"type": "Progressing", "status": "True",
                                     "reason": "NewReplicaSetAvailable"}]}  # fmt: skip
    rec.on_deployment_event("MODIFIED", dep)
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")


def test_a_picker_name_taken_by_someone_else_is_a_conflict(kube, rec):
    kube.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "chat-epp"}})
    rec.reconcile(kube.add_isvc("chat", routing()))
    assert conds(kube.status("chat"))["Degraded"] == ("True", "NameConflict")
    assert ("Deployment", NS, "chat-epp") not in kube.objects
