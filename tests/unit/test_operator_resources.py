"""The pure builders: a snapshot of the GPU sample's children, and properties that hold for
every valid spec (owners, labels, probes, drain timing, rollout, pass-through, args)."""

from __future__ import annotations

import argparse
import math
import os
from fractions import Fraction
from pathlib import Path

import jsonschema_rs
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot import names
from batchpilot.operator import drift
from batchpilot.operator.children import secret
from batchpilot.operator.children.autoscaler import HPA_KIND, SCALED_OBJECT_KIND, autoscaler_kind
from batchpilot.operator.children.build import build_children, optional_kinds, stale_kinds
from batchpilot.operator.children.engine_args import (
    MAX_NUM_SEQS_ENV,
    engine_settings,
    read_engine_settings,
)
from batchpilot.operator.children.meta import (
    LABEL_SERVICE,
    MANAGED_BY,
    Owner,
    owner_reference,
    selector_labels,
)
from batchpilot.operator.children.plan import desired_replicas, effective_engine, plan_model
from batchpilot.operator.children.pod import (
    HOME,
    LABEL_SA_ALLOWED,
    RUN_AS_USER,
    SCRATCH_VOLUMES,
    service_account_allowed,
    spec_problems,
)
from batchpilot.operator.children.pool import INFERENCE_POOL_KIND
from batchpilot.operator.children.quantity import parse_quantity, quantity
from batchpilot.operator.children.secret import admin_token, build_secret
from batchpilot.operator.children.service import (
    ENDPOINT_SLICE_KIND,
    LABEL_ROUTED,
    SLICE_MANAGED_BY,
    SLICE_SERVICE_NAME,
    Activator,
    activator_of,
    build_service,
    routes_to_activator,
)
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.flags import ENGINE_KNOBS
from batchpilot.operator.loop.state import LoopState

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "operator_gpu_sample_children.yaml"
OWNER = Owner(name="chat", namespace="team-a", uid="0000-uid")
IMAGE = "registry.example/batchpilot-server:test"
TOKEN = "s3cret-token"


def children(
    spec: dict, loops: LoopState = LoopState(), token: str = TOKEN, activator=None
) -> list[dict]:
    return build_children(
        OWNER, parse_spec(spec), image=IMAGE, admin_token=token, loops=loops, activator=activator
    )


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def deployment(spec: dict, **kw) -> dict:
    (dep,) = [c for c in children(spec, **kw) if c["kind"] == "Deployment"]
    return dep


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_snapshot_of_the_gpu_sample():
    """The whole output for one realistic spec. Regenerate after an intended change with
    BATCHPILOT_UPDATE_SNAPSHOTS=1 and review the diff."""
    got = yaml.safe_dump_all(children(example("gpu-fp8-tuning.yaml")["spec"]), sort_keys=False)
    if os.environ.get("BATCHPILOT_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(got)
    assert got == SNAPSHOT.read_text()


def test_examples_parse():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "InferenceService":
                parse_spec(doc["spec"])


def test_server_args_parse_with_the_servers_own_cli():
    """Every flag the operator passes is one `batchpilot serve` accepts, with the value the
    spec asked for."""
    from batchpilot.server.api.cli import add_arguments
    from batchpilot.server.config import GiB, config_from_args

    spec = {
        "engine": {
            "maxNumSeqs": 96,
            "kvCacheDtype": "fp8_e5m2",
            "maxModelLen": 2048,
            "maxNumBatchedTokens": 4096,
            "enablePrefixCaching": False,
            "preemptionMode": "recompute",
            "swapSpaceGiB": 1.5,
            "blockSize": 32,
            "gpuMemoryUtilization": 0.85,
            "dtype": "bfloat16",
            "extraArgs": ["--kv-cache-memory", "2GiB"],
        },
        "server": {"shutdownTimeoutSeconds": 45, "maxQueueLen": 77},
        "model": {"source": "/models/llama", "name": "llama"},
    }
    args = container(deployment(spec))["args"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(args)
    cfg = config_from_args(ns)
    assert (cfg.max_num_seqs, cfg.kv_cache_dtype, cfg.max_model_len) == (96, "fp8_e5m2", 2048)
    assert cfg.max_num_batched_tokens == 4096 and cfg.enable_prefix_caching is False
    assert cfg.enable_chunked_prefill is True and cfg.preemption_mode == "recompute"
    assert cfg.swap_space_bytes == int(1.5 * GiB) and cfg.block_size == 32
    assert cfg.gpu_memory_utilization == 0.85 and cfg.dtype == "bfloat16"
    assert cfg.kv_cache_memory_bytes == 2 * GiB
    assert (ns.model, ns.served_model_name, ns.host, ns.port) == (
        "/models/llama",
        "llama",
        "0.0.0.0",
        8000,
    )
    assert (ns.shutdown_timeout, ns.max_queue_len) == (45, 77)


@pytest.mark.parametrize(
    "source, name, arg, served, pvc",
    [
        ("bundled", None, "bundled", names.DEFAULT_SERVED_MODEL_NAME, None),
        ("bundled", "mine", "bundled", "mine", None),
        ("/models/q.gguf", None, "/models/q.gguf", "q", None),
        ("pvc://weights/llama-3", None, "/models/weights/llama-3", "llama-3", "weights"),
        ("pvc://weights", None, "/models/weights", "weights", "weights"),
        ("pvc://w/../../etc", None, "/models/w", "w", "w"),
        ("pvc://w/../wx", None, "/models/w", "w", "w"),
        ("hf://Qwen/Qwen2-0.5B", None, "hf://Qwen/Qwen2-0.5B", "Qwen2-0.5B", None),
    ],
)
def test_plan_model(source, name, arg, served, pvc):
    plan = plan_model(parse_spec({"model": {"source": source, "name": name}}), IMAGE)
    assert (plan.arg, plan.served_name, plan.pvc) == (arg, served, pvc)


def test_pvc_source_is_mounted_read_only():
    dep = deployment({"model": {"source": "pvc://weights/llama"}})
    pod = dep["spec"]["template"]["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    mounts = container(dep)["volumeMounts"]
    assert {"name": "model", "mountPath": "/models/weights", "readOnly": True} in mounts


def test_hf_source_runs_offline():
    env = container(deployment({"model": {"source": "hf://org/m"}}))["env"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in env


def test_spec_problems():
    spec = parse_spec({"pod": {"env": [{"name": names.ADMIN_TOKEN_ENV, "value": "x"}]}})
    assert spec_problems(spec) == [f"spec.pod.env: {names.ADMIN_TOKEN_ENV} is set by the operator"]
    assert spec_problems(parse_spec({"engine": {"extraArgs": ["--seed", "3"]}})) == []


def test_loops_are_persisted_within_bounds():
    tuning = {"enabled": True, "maxNumSeqs": {"min": 8, "max": 128}, "allowFP8KVCache": True}
    spec = {
        "tuning": tuning,
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5},
        "replicas": 1,
    }
    dep = deployment(spec, loops=LoopState(replicas=9, max_num_seqs=500, kv_cache_dtype="fp8"))
    engine = read_engine_settings(dep)
    assert (dep["spec"]["replicas"], engine["maxNumSeqs"], engine["kvCacheDtype"]) == (
        5,
        128,
        "fp8",
    )
    # Nothing decided yet: autoscaling starts at minReplicas, the engine at spec.engine.
    dep = deployment(spec)
    assert dep["spec"]["replicas"] == 2
    assert read_engine_settings(dep)["maxNumSeqs"] == 64
    # fp8 only when allowed; decisions are ignored while the loop is disabled.
    no_fp8 = {**spec, "tuning": {**tuning, "allowFP8KVCache": False}}
    dep = deployment(no_fp8, loops=LoopState(kv_cache_dtype="fp8"))
    assert read_engine_settings(dep)["kvCacheDtype"] == "auto"
    dep = deployment({"replicas": 3}, loops=LoopState(replicas=9, max_num_seqs=9))
    assert dep["spec"]["replicas"] == 3
    assert read_engine_settings(dep)["maxNumSeqs"] == 64


def test_loop_state_from_status():
    status = {
        "autoscaling": {"desiredReplicas": 3},
        "tuning": {"maxNumSeqs": 40, "kvCacheDtype": "fp8"},
    }
    assert LoopState.from_status(status) == LoopState(3, 40, "fp8")
    assert LoopState.from_status(None) == LoopState()
    status["tuning"]["maxNumBatchedTokens"] = 1024
    assert LoopState.from_status(status).max_num_batched_tokens == 1024


def test_token_rotation_rolls_the_pods():
    """The token's Secret is named after a hash of it: a new token is a new Secret and a
    new pod template, and neither the name nor the template carries the token."""
    one, two = "tok-one-5b1c", "tok-two-9e2d"
    a, b = children({}, token=one), children({}, token=two)
    assert a[0]["metadata"]["name"] != b[0]["metadata"]["name"]
    assert a[-1]["spec"]["template"] != b[-1]["spec"]["template"]
    assert one not in str(a[-1]) and two not in str(b[-1])


def test_admin_token_is_derived_from_the_key_and_the_objects_identity():
    token = admin_token(b"key-1", OWNER)
    assert token == admin_token(b"key-1", OWNER) and len(token) >= 43  # 256 bits
    others = [
        admin_token(b"key-2", OWNER),
        admin_token(b"key-1", Owner(name="chat", namespace="team-a", uid="another-uid")),
        admin_token(b"key-1", Owner(name="chat", namespace="team-b", uid="0000-uid")),
        admin_token(b"key-1", Owner(name="chat2", namespace="team-a", uid="0000-uid")),
    ]
    assert len({token, *others}) == 5
    name = secret.secret_name("chat", token)
    assert name.startswith("chat-admin-") and token not in name
    assert name != secret.secret_name("chat", others[0])


def test_pods_pass_the_restricted_pod_security_standard():
    """What the restricted profile asks of a pod, plus a read-only root filesystem with
    emptyDirs where the server writes, and the variables that point there."""
    dep = deployment({"model": {"source": "pvc://weights/llama"}})
    pod = dep["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == RUN_AS_USER != 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    c = container(dep)
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert key not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for name, path in SCRATCH_VOLUMES:
        assert volumes[name] == {"name": name, "emptyDir": {}} and mounts[path] == name
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == HOME
    for var in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR"):
        assert env[var].startswith(HOME + "/")
    # The model claim stays read-only.
    assert mounts["/models/weights"] == "model"


def test_admin_port_is_on_the_pod_not_on_the_service():
    out = children({})
    svc, dep = out[2], out[4]
    c = container(dep)
    assert {"name": "admin", "containerPort": names.DEFAULT_ADMIN_PORT, "protocol": "TCP"} in c[
        "ports"
    ]
    assert c["args"][c["args"].index("--admin-port") + 1] == str(names.DEFAULT_ADMIN_PORT)
    assert [p["port"] for p in svc["spec"]["ports"]] == [names.DEFAULT_PORT]
    # Probes stay on the public port.
    assert c["readinessProbe"]["httpGet"]["port"] == "http"


def test_service_account_allow_list():
    sa = {"metadata": {"name": "sa", "labels": {LABEL_SA_ALLOWED: "allowed"}}}
    assert service_account_allowed(sa)
    assert not service_account_allowed({"metadata": {"name": "sa"}})
    assert not service_account_allowed({"metadata": {"labels": {LABEL_SA_ALLOWED: "yes"}}})


def test_contains_and_drifted():
    svc = build_service(OWNER)
    live = {
        **svc,
        "spec": {**svc["spec"], "clusterIP": "10.0.0.3"},
        "metadata": {**svc["metadata"], "resourceVersion": "7"},
    }
    assert not drift.drifted(svc, live)
    edited = {**live, "spec": {**live["spec"], "selector": {"app": "other"}}}
    assert drift.drifted(svc, edited)
    relabeled = {**live, "metadata": {**live["metadata"], "labels": {}}}
    assert drift.drifted(svc, relabeled)
    dep = deployment({})
    # A Deployment's spec is compared by generation, not here; its metadata is.
    assert not drift.drifted(dep, {**dep, "spec": {}})
    assert drift.drifted(dep, {**dep, "metadata": {**dep["metadata"], "ownerReferences": []}})
    assert drift.contains({"a": [1, {"b": 2, "c": 3}]}, {"a": [1, {"b": 2}]})
    assert not drift.contains({"a": [1]}, {"a": [1, 2]})


# --------------------------------------------------------------------------- properties

_quantity = st.one_of(st.integers(1, 64).map(str), st.sampled_from(["500m", "2Gi", "1.5"]))
_valid = st.fixed_dictionaries(
    {},
    optional={
        "replicas": st.integers(0, 20),
        "image": st.sampled_from(["img:1", "registry.example/x@sha256:" + "a" * 64]),
        "model": st.fixed_dictionaries(
            {"source": st.sampled_from(["bundled", "/m/x.gguf", "pvc://c/p", "hf://o/n"])}
        ),
        "resources": st.fixed_dictionaries(
            {},
            optional={
                "limits": st.dictionaries(
                    st.sampled_from(["cpu", "memory", "nvidia.com/gpu"]), _quantity, max_size=3
                ),
                "requests": st.dictionaries(
                    st.sampled_from(["cpu", "memory"]), _quantity, max_size=2
                ),
            },
        ),
        "engine": st.fixed_dictionaries(
            {},
            optional={
                "maxNumSeqs": st.integers(1, 4096),
                "kvCacheDtype": st.sampled_from(names.KV_CACHE_DTYPES),
                "gpuMemoryUtilization": st.sampled_from([0.1, 0.5, 0.9, 0.99]),
                "maxModelLen": st.integers(16, 8192),
                "swapSpaceGiB": st.sampled_from([0, 0.5, 4, 64]),
                "enablePrefixCaching": st.booleans(),
                "preemptionMode": st.sampled_from(names.PREEMPTION_MODES),
            },
        ),
        "autoscaling": st.fixed_dictionaries(
            {
                "enabled": st.booleans(),
                "mode": st.sampled_from(["builtin", "hpa", "keda"]),
                "targetQueueLength": st.sampled_from([0.5, 4, 2000]),
                "keda": st.just({"serverAddress": "http://prometheus.monitoring:9090"}),
            }
        ),
        "tuning": st.fixed_dictionaries(
            {"enabled": st.booleans(), "maxNumSeqs": st.just({"min": 1, "max": 4096})}
        ),
        "server": st.fixed_dictionaries(
            {},
            optional={
                "shutdownTimeoutSeconds": st.integers(1, 3600),
                "preStopSleepSeconds": st.integers(0, 300),
            },
        ),
        "pod": st.fixed_dictionaries(
            {},
            optional={
                "nodeSelector": st.dictionaries(
                    st.sampled_from(["gpu", "zone"]), st.text("abc", min_size=1), max_size=2
                ),
                "tolerations": st.lists(
                    st.fixed_dictionaries(
                        {
                            "key": st.sampled_from(["nvidia.com/gpu", "x"]),
                            "operator": st.just("Exists"),
                            "effect": st.just("NoSchedule"),
                        }
                    ),
                    max_size=2,
                ),
                "affinity": st.just(
                    {
                        "nodeAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 1,
                                    "preference": {
                                        "matchExpressions": [{"key": "k", "operator": "Exists"}]
                                    },
                                }
                            ]
                        }
                    }
                ),
                "env": st.lists(
                    st.fixed_dictionaries(
                        {"name": st.sampled_from(["A", "B"]), "value": st.text("xy", max_size=3)}
                    ),
                    max_size=2,
                ),
                "serviceAccountName": st.sampled_from(["sa-1", "reader"]),
                "labels": st.dictionaries(
                    st.sampled_from(["team", LABEL_SERVICE]),
                    st.sampled_from(["a", "evil"]),
                    max_size=2,
                ),
                "annotations": st.dictionaries(
                    st.sampled_from(["note", "prometheus.io/port"]), st.just("1"), max_size=2
                ),
            },
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(_valid)
def test_properties_of_every_valid_spec(raw):
    spec = parse_spec(raw)
    out = build_children(OWNER, spec, image=IMAGE, admin_token=TOKEN)
    kinds = ["Secret", "ConfigMap", "Service", "PodDisruptionBudget", "Deployment"]
    autoscaler = autoscaler_kind(spec)
    assert [c["kind"] for c in out] == kinds + ([autoscaler[1]] if autoscaler else [])
    # Deterministic: a re-apply never rolls the Deployment.
    assert out == build_children(OWNER, spec, image=IMAGE, admin_token=TOKEN)
    selector = selector_labels("chat")
    for child in out:
        meta = child["metadata"]
        assert meta["name"].startswith("chat") and meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "batchpilot.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "chat",
                "uid": "0000-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][LABEL_SERVICE] == "chat"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "batchpilot-operator"
        assert {"app.kubernetes.io/name", "app.kubernetes.io/instance"} <= set(meta["labels"])

    (dep,) = [c for c in out if c["kind"] == "Deployment"]
    ds = dep["spec"]
    assert ds["selector"] == {"matchLabels": selector}
    tmpl = ds["template"]
    assert selector.items() <= tmpl["metadata"]["labels"].items()  # user labels never win
    ann = tmpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann["prometheus.io/path"] == "/metrics"
    assert ds["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    if not spec.autoscaling.builtin:
        assert ds["replicas"] == spec.replicas

    pod = tmpl["spec"]
    c = container(dep)
    assert c["image"] == IMAGE
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Drain: preStop sleep, then SIGTERM, and the kubelet waits longer than both.
    sleep = spec.server.pre_stop_sleep_seconds
    if sleep:
        assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": sleep}}
    else:
        assert "lifecycle" not in c
    shutdown = spec.server.shutdown_timeout_seconds
    assert pod["terminationGracePeriodSeconds"] > sleep + shutdown
    assert c["args"][c["args"].index("--shutdown-timeout") + 1] == str(shutdown)
    # The admin token comes from the owned Secret.
    secret_name = secret.secret_name("chat", TOKEN)
    token_env = {
        "name": names.ADMIN_TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "token"}},
    }
    assert c["env"][0] == token_env
    assert out[0]["data"]["token"] and out[0]["metadata"]["name"] == secret_name
    # Pass-through.
    want_resources = {
        k: {n: str(q) for n, q in v.items()} for k, v in (raw.get("resources") or {}).items() if v
    }
    assert c.get("resources", {}) == want_resources
    p = raw.get("pod") or {}
    assert pod.get("nodeSelector", {}) == p.get("nodeSelector", {})
    assert pod.get("tolerations", []) == p.get("tolerations", [])
    assert pod.get("affinity") == p.get("affinity")
    user_env = p.get("env", [])
    assert c["env"][len(c["env"]) - len(user_env) :] == user_env
    if "serviceAccountName" in p:
        assert pod["serviceAccountName"] == p["serviceAccountName"]
    else:
        assert pod["automountServiceAccountToken"] is False
    # The Deployment records exactly the spec's engine settings, and the args carry them.
    engine = read_engine_settings(dep)
    assert engine == engine_settings(spec.engine)
    assert engine["maxNumSeqs"] == spec.engine.max_num_seqs
    assert engine["kvCacheDtype"] == spec.engine.kv_cache_dtype
    assert engine.get("maxModelLen") == spec.engine.max_model_len
    flags = {a.split("=", 1)[0] for a in c["args"]}
    # max_num_seqs: a literal flag, or (tuning on) the ConfigMap's value through the env.
    (config_map,) = [x for x in out if x["kind"] == "ConfigMap"]
    assert config_map["data"] == {"max_num_seqs": str(spec.engine.max_num_seqs)}
    live = f"--max-num-seqs=$({MAX_NUM_SEQS_ENV})"
    assert (live in c["args"]) == spec.tuning.enabled
    assert any(e["name"] == MAX_NUM_SEQS_ENV for e in c["env"]) == spec.tuning.enabled
    # A CPU pod's thread budget: its CPU limit, else its request, rounded up.
    threads = [e["value"] for e in c["env"][: len(c["env"]) - len(user_env)]
               if e["name"] == names.CPU_THREADS_ENV]  # fmt: skip
    res = raw.get("resources") or {}
    cpu = (res.get("limits") or {}).get("cpu", (res.get("requests") or {}).get("cpu"))
    gpu = "nvidia.com/gpu" in (res.get("limits") or {})
    assert threads == ([] if gpu or cpu is None else [str(max(1, math.ceil(parse_quantity(cpu))))])
    for autoscaler in out[5:]:
        if autoscaler["kind"] == "ScaledObject":
            jsonschema_rs.validate(SCALED_OBJECT_SCHEMA, autoscaler)
        assert autoscaler["spec"]["scaleTargetRef"] == {
            "apiVersion": "batchpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "chat",
        }
    for knob in ENGINE_KNOBS:
        assert (
            knob.flag in flags
            or "--no-" + knob.flag[2:] in flags
            or (getattr(spec.engine, knob.name, None) is None)
        ), knob

    svc, pdb = out[2], out[3]
    assert svc["spec"]["selector"] == selector
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert pdb["spec"]["selector"] == {"matchLabels": selector}
    assert pdb["spec"]["maxUnavailable"] == 1


def test_foreign_managers_and_restored():
    svc = build_service(OWNER)
    live = {
        **svc,
        "spec": {
            **svc["spec"],
            "clusterIP": "10.0.0.9",
            "clusterIPs": ["10.0.0.9"],
            "selector": {**svc["spec"]["selector"], "app": "x"},
        },
        "status": {"loadBalancer": {}},
        "metadata": {
            **svc["metadata"],
            "resourceVersion": "12",
            "managedFields": [
                {
                    "manager": "batchpilot-operator",
                    "operation": "Apply",
                    "fieldsV1": {"f:spec": {}},
                },
                {
                    "manager": "kube-controller-manager",
                    "subresource": "status",
                    "fieldsV1": {"f:status": {}},
                },
            ],
        },
    }
    assert drift.foreign_managers(live, "batchpilot-operator") == []
    live["metadata"]["managedFields"].append(
        {
            "manager": "kubectl-patch",
            "operation": "Update",
            "fieldsV1": {"f:spec": {"f:selector": {}}},
        }
    )
    assert drift.foreign_managers(live, "batchpilot-operator") == ["kubectl-patch"]
    body = drift.restored(live, svc)
    assert body["spec"]["selector"] == selector_labels("chat")
    assert body["spec"]["clusterIP"] == "10.0.0.9" and body["spec"]["clusterIPs"] == ["10.0.0.9"]
    assert body["metadata"]["resourceVersion"] == "12" and "managedFields" not in body["metadata"]
    assert "status" not in body
    secret = build_secret(OWNER, "tok")
    live_secret = {
        **secret,
        "data": {**secret["data"], "extra": "eA=="},
        "metadata": secret["metadata"],
    }
    assert drift.restored(live_secret, secret)["data"] == secret["data"]


# --------------------------------------------------------------------------- the loop's children

# The parts of KEDA's ScaledObject CRD (keda.sh/v1alpha1, config/crd/bases in kedacore/keda)
# that the operator emits, strict about unknown fields so a misspelt one fails here: KEDA's
# CRD is not installed in the test cluster.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_RULES = {
    "type": "object",
    "properties": {"stabilizationWindowSeconds": {**_INT32, "maximum": 3600}},
    "additionalProperties": False,
}
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"scaleUp": _RULES, "scaleDown": _RULES},
                                }
                            },
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "prometheus"},
                            # KEDA's trigger metadata is a map of strings.
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}

AUTOSCALING = {
    "enabled": True,
    "minReplicas": 2,
    "maxReplicas": 7,
    "targetQueueLength": 2.5,
    "scaleUpStabilizationSeconds": 15,
    "scaleDownStabilizationSeconds": 600,
}


def test_hpa_on_the_waiting_queue_of_the_service():
    (hpa,) = children({"autoscaling": {**AUTOSCALING, "mode": "hpa"}})[5:]
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["metadata"]["name"] == "chat"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"]["kind"] == "InferenceService"
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 7)
    assert spec["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {
                    "name": "vllm:num_requests_waiting",
                    "selector": {"matchLabels": {"namespace": "team-a", "service": "chat"}},
                },
                "target": {"type": "AverageValue", "averageValue": "2500m"},
            },
        }
    ]
    assert spec["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 15},
        "scaleDown": {"stabilizationWindowSeconds": 600},
    }


def test_keda_scaled_object_validates_against_the_schema():
    keda = {"serverAddress": "http://prometheus.monitoring:9090"}
    (so,) = children({"autoscaling": {**AUTOSCALING, "mode": "keda", "keda": keda}})[5:]
    jsonschema_rs.validate(SCALED_OBJECT_SCHEMA, so)
    trigger = so["spec"]["triggers"][0]["metadata"]
    assert trigger == {
        "serverAddress": "http://prometheus.monitoring:9090",
        "query": 'sum(vllm:num_requests_waiting{namespace="team-a",service="chat"})',
        "threshold": "2.5",
    }
    custom = {**keda, "query": "sum(rate(x[1m]))"}
    (so,) = children({"autoscaling": {**AUTOSCALING, "mode": "keda", "keda": custom}})[5:]
    assert so["spec"]["triggers"][0]["metadata"]["query"] == "sum(rate(x[1m]))"
    with pytest.raises(ValueError):  # the schema catches what KEDA would refuse
        jsonschema_rs.validate(SCALED_OBJECT_SCHEMA, {**so, "spec": {**so["spec"], "x": 1}})


def test_no_autoscaler_child_unless_asked():
    for autoscaling in ({**AUTOSCALING, "mode": "builtin"}, {"mode": "hpa"}):
        spec = parse_spec({"autoscaling": autoscaling})
        assert len(children({"autoscaling": autoscaling})) == 5
        optional = [HPA_KIND, SCALED_OBJECT_KIND, INFERENCE_POOL_KIND, ENDPOINT_SLICE_KIND]
        assert stale_kinds(spec) == optional
    spec = parse_spec({"autoscaling": {**AUTOSCALING, "mode": "hpa"}})
    assert stale_kinds(spec) == [
        SCALED_OBJECT_KIND,
        INFERENCE_POOL_KIND,
        ENDPOINT_SLICE_KIND,
    ]


ROUTING = {"inferencePool": True, "endpointPicker": {"name": "epp", "port": 9002}}


def test_inference_pool_selects_the_server_pods_on_the_serving_port():
    *_, pool = children({"routing": ROUTING})
    assert (pool["apiVersion"], pool["kind"]) == INFERENCE_POOL_KIND
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["namespace"] == "team-a"
    assert pool["metadata"]["ownerReferences"] == [owner_reference(OWNER)]
    # The Deployment's pods, exactly: the same selector as the Service.
    pods = deployment({"routing": ROUTING})["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"] == {"matchLabels": pods}
    assert pool["spec"]["targetPorts"] == [{"number": names.DEFAULT_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # It is built after the Deployment, with the autoscaler, and is not stale while asked for.
    spec = parse_spec({"routing": ROUTING})
    assert optional_kinds(spec) == [INFERENCE_POOL_KIND]
    assert INFERENCE_POOL_KIND not in stale_kinds(spec)


def test_no_inference_pool_unless_asked():
    for routing in ({}, {"inferencePool": False, "endpointPicker": {"name": "epp"}}):
        spec = parse_spec({"routing": routing})
        assert all(c["kind"] != "InferencePool" for c in children({"routing": routing}))
        assert INFERENCE_POOL_KIND in stale_kinds(spec)
    with pytest.raises(ValueError, match=r"routing\.endpointPicker is required"):
        parse_spec({"routing": {"inferencePool": True}})


ZERO = {"autoscaling": {"enabled": True, "minReplicas": 0}}
ACTIVATOR = Activator(("10.244.0.10", "10.244.0.9"), 8080)  # sorted as text


def activator_slices(port_name: str = "http") -> list[dict]:
    """The activator Service's EndpointSlices as the EndpointSlice controller writes them."""
    endpoint = {"addresses": ["10.244.0.10"], "conditions": {"ready": True}}
    return [
        {
            "endpoints": [
                endpoint,
                {"addresses": ["10.244.0.9"], "conditions": {"ready": True}},
                {"addresses": ["10.244.0.11"], "conditions": {"ready": False}},  # terminating
            ],
            "ports": [{"name": port_name, "port": 8080, "protocol": "TCP"}],
        },
        {"endpoints": [endpoint], "ports": [{"name": port_name, "port": 8080}]},
    ]


def test_activator_endpoints_are_its_ready_addresses_on_the_http_port():
    assert activator_of(activator_slices()) == ACTIVATOR
    assert activator_of(activator_slices("metrics")) is None  # no http port yet
    assert activator_of([]) is None


@pytest.mark.parametrize(
    "spec, desired, ready, routed",
    [
        (ZERO, 0, 0, True),  # at zero
        (ZERO, 1, 0, True),  # woken, the first replica still starting
        (ZERO, 1, 1, False),  # a replica serves
        (ZERO, 2, 1, False),
        ({"autoscaling": {"enabled": True}}, 1, 0, False),  # minReplicas 1: never
        ({"replicas": 0}, 0, 0, False),  # no autoscaling: a stopped service stays stopped
        ({"autoscaling": {"enabled": True, "minReplicas": 0, "mode": "keda",
                          "keda": {"serverAddress": "http://p:9090"}}}, 0, 0, False),
    ],
)  # fmt: skip
def test_routes_to_the_activator_only_while_no_replica_of_a_zero_capable_service_is_ready(
    spec, desired, ready, routed
):
    assert routes_to_activator(parse_spec(spec), desired, ready, ACTIVATOR) is routed
    assert routes_to_activator(parse_spec(spec), desired, ready, None) is False


def test_at_zero_the_service_has_no_selector_and_the_activators_endpoints():
    built = children(ZERO, activator=ACTIVATOR)
    kinds = [c["kind"] for c in built]
    # The slice exists before the Service drops its selector: no moment without endpoints.
    assert kinds.index("EndpointSlice") < kinds.index("Service")
    (service,) = [c for c in built if c["kind"] == "Service"]
    # A selector no pod matches: the EndpointSlice controller keeps its slices in sync
    # (empty), so none of them keeps a pod that is gone.
    assert service["spec"]["selector"] == {**selector_labels("chat"), LABEL_ROUTED: "activator"}
    pod_labels = deployment(ZERO)["spec"]["template"]["metadata"]["labels"]
    assert LABEL_ROUTED not in pod_labels
    assert service["spec"]["ports"][0]["name"] == "http"
    (eps,) = [c for c in built if c["kind"] == "EndpointSlice"]
    assert eps["metadata"]["name"] == "chat"
    assert eps["metadata"]["labels"][SLICE_SERVICE_NAME] == "chat"
    # Not the EndpointSlice controller's value: it would delete a slice it does not own.
    assert eps["metadata"]["labels"][SLICE_MANAGED_BY] == MANAGED_BY
    assert eps["metadata"]["ownerReferences"] == [owner_reference(OWNER)]
    assert eps["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    assert [e["addresses"] for e in eps["endpoints"]] == [["10.244.0.10"], ["10.244.0.9"]]
    spec = parse_spec(ZERO)
    assert ENDPOINT_SLICE_KIND not in stale_kinds(spec, to_activator=True)
    # Back above zero: the selector again, and the slice is stale.
    (service,) = [c for c in children(ZERO) if c["kind"] == "Service"]
    assert service["spec"]["selector"] == selector_labels("chat")
    assert ENDPOINT_SLICE_KIND in stale_kinds(spec)


@pytest.mark.parametrize(
    "value, text",
    [
        (4, "4"),
        (4.0, "4"),
        (0.5, "500m"),
        (2.5, "2500m"),
        (2000, "2k"),
        (1e-6, "1m"),
        (1500, "1500"),
    ],
)
def test_quantity_is_canonical(value, text):
    assert quantity(value) == text


def test_tuned_max_num_seqs_changes_the_config_map_not_the_pod_template():
    spec = {"tuning": {"enabled": True, "maxNumSeqs": {"min": 8, "max": 128}}}
    a = children(spec, loops=LoopState(max_num_seqs=16))
    b = children(spec, loops=LoopState(max_num_seqs=96))
    assert a[1]["data"] == {"max_num_seqs": "16"} and b[1]["data"] == {"max_num_seqs": "96"}
    assert a[4]["spec"] == b[4]["spec"]  # the same pod template: nothing rolls
    assert read_engine_settings(b[4])["maxNumSeqs"] == 96
    env = {e["name"]: e for e in container(a[4])["env"]}
    assert env[MAX_NUM_SEQS_ENV]["valueFrom"] == {
        "configMapKeyRef": {"name": "chat-engine", "key": "max_num_seqs"}
    }
    # An fp8 switch does change the pod template: the Deployment rolls.
    spec["tuning"]["allowFP8KVCache"] = True
    c = children(spec, loops=LoopState(max_num_seqs=96, kv_cache_dtype="fp8"))
    assert c[4]["spec"]["template"] != b[4]["spec"]["template"]


TUNED_BUDGET = {"enabled": True, "maxNumBatchedTokens": {"min": 256, "max": 4096}}


def test_tuned_step_budget_is_clamped_within_its_range():
    spec = parse_spec({"tuning": TUNED_BUDGET})
    for tuned, want in ((1024, 1024), (64, 256), (10_000, 4096)):
        engine = effective_engine(spec, LoopState(max_num_batched_tokens=tuned))
        assert engine.max_num_batched_tokens == want
    # Nothing decided: spec.engine's value, else the range's max (what pods start with).
    assert effective_engine(spec, LoopState()).max_num_batched_tokens == 4096
    spec = parse_spec({"tuning": TUNED_BUDGET, "engine": {"maxNumBatchedTokens": 512}})
    assert effective_engine(spec, LoopState()).max_num_batched_tokens == 512
    # Not tuned (no range, or the tuner off): a decision is ignored.
    for tuning in ({"enabled": True}, {**TUNED_BUDGET, "enabled": False}):
        spec = parse_spec({"tuning": tuning, "engine": {"maxNumBatchedTokens": 512}})
        engine = effective_engine(spec, LoopState(max_num_batched_tokens=1024))
        assert engine.max_num_batched_tokens == 512


def test_tuned_step_budget_changes_the_config_map_not_the_pod_template():
    a = children({"tuning": TUNED_BUDGET}, loops=LoopState(max_num_batched_tokens=512))
    b = children({"tuning": TUNED_BUDGET}, loops=LoopState(max_num_batched_tokens=2048))
    assert a[1]["data"] == {"max_num_seqs": "64", "max_num_batched_tokens": "512"}
    assert b[1]["data"]["max_num_batched_tokens"] == "2048"
    assert a[4] == b[4]  # the same Deployment, pod template and annotation: nothing rolls
    # Pods start with the range's max, the budget the engine profiles at start-up, so any
    # tuned value within the range fits live; the annotation records that start.
    args = container(a[4])["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert read_engine_settings(a[4])["maxNumBatchedTokens"] == 4096


def test_an_untuned_step_budget_is_the_spec_engines():
    spec = {"tuning": {"enabled": True}, "engine": {"maxNumBatchedTokens": 1024}}
    out = children(spec, loops=LoopState(max_num_batched_tokens=512))
    assert out[1]["data"] == {"max_num_seqs": "64"}
    args = container(out[4])["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "1024"


def test_live_max_num_seqs_arg_parses_with_the_servers_own_cli_once_expanded():
    """Kubernetes expands $(VAR) in args from the container's env; the expanded args are
    ones `batchpilot serve` accepts, with the ConfigMap's value."""
    from batchpilot.server.api.cli import add_arguments
    from batchpilot.server.config import config_from_args

    out = children({"tuning": {"enabled": True}, "engine": {"maxNumSeqs": 24}})
    value = out[1]["data"]["max_num_seqs"]
    args = [a.replace(f"$({MAX_NUM_SEQS_ENV})", value) for a in container(out[4])["args"]]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(args)).max_num_seqs == 24


def test_reserved_env_is_refused():
    spec = parse_spec({"pod": {"env": [{"name": MAX_NUM_SEQS_ENV, "value": "4"}]}})
    assert spec_problems(spec) == [f"spec.pod.env: {MAX_NUM_SEQS_ENV} is set by the operator"]


def test_turning_builtin_autoscaling_on_keeps_the_running_count_until_the_loop_decides():
    spec = parse_spec(
        {"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}
    )
    assert desired_replicas(spec, LoopState()) == 3
    assert desired_replicas(spec, LoopState(replicas=2)) == 2
    tight = parse_spec(
        {"replicas": 9, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}
    )
    assert desired_replicas(tight, LoopState()) == 4


@pytest.mark.parametrize(
    "value, number",
    [
        ("2", 2),
        (2, 2),
        ("1500m", Fraction(3, 2)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("1e3", 1000),
        ("2k", 2000),
        ("1Gi", 1 << 30),
        ("250u", Fraction(1, 4000)),
        ("abc", None),
        ("1e1.5", None),
    ],
)
def test_parse_quantity(value, number):
    assert parse_quantity(value) == number


def _threads_env(spec: dict) -> list[str]:
    return [e["value"] for e in container(deployment(spec))["env"]
            if e["name"] == names.CPU_THREADS_ENV]  # fmt: skip


@pytest.mark.parametrize(
    "resources, threads",
    [
        ({"requests": {"cpu": "2"}}, ["2"]),
        ({"requests": {"cpu": "1500m"}}, ["2"]),  # rounded up
        ({"requests": {"cpu": "100m"}}, ["1"]),  # at least one
        ({"requests": {"cpu": "2"}, "limits": {"cpu": 3}}, ["3"]),  # the limit first
        ({"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}, ["2"]),
        ({"requests": {"memory": "2Gi"}}, []),  # no CPU amount: the server's own reading
        ({}, []),
        ({"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": 1}}, []),  # a GPU pod
        ({"requests": {"cpu": "4"}, "limits": {"amd.com/gpu": "1"}}, []),
        ({"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": 0}}, ["4"]),  # no GPU asked
    ],
)
def test_cpu_pods_get_a_thread_budget_from_their_cpu(resources, threads):
    assert _threads_env({"resources": resources}) == threads


def test_the_cpu_sample_gets_two_threads_and_the_gpu_sample_none():
    assert _threads_env(example("cpu-bundled.yaml")["spec"]) == ["2"]
    assert _threads_env(example("gpu-fp8-tuning.yaml")["spec"]) == []


@pytest.mark.parametrize("name", [names.CPU_THREADS_ENV, "OMP_NUM_THREADS"])
def test_threads_set_in_pod_env_win(name):
    spec = {"resources": {"limits": {"cpu": "4"}}, "pod": {"env": [{"name": name, "value": "3"}]}}
    env = container(deployment(spec))["env"]
    assert [e for e in env if e["name"] in (names.CPU_THREADS_ENV, "OMP_NUM_THREADS")] == [
        {"name": name, "value": "3"}
    ]
    assert spec_problems(parse_spec(spec)) == []


def test_the_thread_budget_is_what_the_server_runs():
    """The server reads the variable the operator sets: 3 threads on a 64-CPU node."""
    from batchpilot.server.platform.cpu_budget import resolve_cpu_threads

    env = {
        e["name"]: e["value"]
        for e in container(deployment({"resources": {"limits": {"cpu": "2500m"}}}))["env"]
        if "value" in e
    }
    assert resolve_cpu_threads(None, env, 64, None).threads == 3
