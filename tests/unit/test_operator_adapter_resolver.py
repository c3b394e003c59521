"""spec.adapterResolver (vLLM's filesystem LoRA resolver from a volume): the schema, the pod
template (the claim mounted read-only, --lora-resolver-dir, LoRA on) and a missing claim's
Degraded, through the builders and the reconciler against the fake API of
tests/support/fake_kube.py."""

from __future__ import annotations

import pytest

from batchpilot.operator.children.deployment import build_deployment
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.plan import adapter_claims, plan_adapter_resolver
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd import manifests
from batchpilot.operator.crd.spec import SpecError, parse_spec
from batchpilot.operator.flags import LORA_RESOLVER_DIR
from batchpilot.operator.reconcile import Reconciler
from tests.support.fake_kube import KEY, NS, FakeKube, conds

OWNER = Owner("chat", "ns", "uid-1")
MODEL = {"source": "pvc://models/base", "name": "base"}


def spec_with(source: str | None, **extra) -> dict:
    spec = {"model": MODEL, **extra}
    if source is not None:
        spec["adapterResolver"] = {"source": source}
    return spec


def pod_of(spec: dict) -> dict:
    dep = build_deployment(OWNER, parse_spec(spec), image="img", admin_token="t" * 32)
    return dep["spec"]["template"]["spec"]


def args_of(spec: dict) -> list[str]:
    return pod_of(spec)["containers"][0]["args"]


def test_the_schema_takes_a_claim_or_a_container_path():
    for source in ("pvc://loras", "pvc://loras/team/a", "/mnt/adapters"):
        assert parse_spec(spec_with(source)).adapter_resolver.source == source
    bad = ["hf://org/adapters", "relative/dir", "bundled", "", "pvc://Loras/x", "pvc://-x",
           "/" + "a" * 1024]  # fmt: skip
    for source in bad:
        with pytest.raises(SpecError, match=r"adapterResolver\.source"):
            parse_spec(spec_with(source))
    with pytest.raises(SpecError, match="adapterResolver"):
        parse_spec({"adapterResolver": {"source": "/a", "cacheDir": "/b"}})
    with pytest.raises(SpecError, match="adapterResolver"):
        parse_spec({"adapterResolver": {}})
    # The flag is the spec's: engine.extraArgs may not set or abbreviate it.
    for arg in ("--lora-resolver-dir=/x", "--lora-resolver-dir", "--lora-res"):
        with pytest.raises(SpecError, match="extraArgs"):
            parse_spec(spec_with(None, engine={"extraArgs": [arg]}))


def test_the_crd_states_the_same_bounds():
    schema = manifests.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    resolver = schema["properties"]["spec"]["properties"]["adapterResolver"]
    assert resolver["required"] == ["source"]
    source = resolver["properties"]["source"]
    assert source["maxLength"] == 1024 and "hf://" not in source["pattern"]


def test_a_claim_is_mounted_read_only_and_passed_as_the_resolver_dir():
    spec = spec_with("pvc://loras/team/a", engine={"maxLoras": 2})
    pod = pod_of(spec)
    args = pod["containers"][0]["args"]
    assert args[args.index(LORA_RESOLVER_DIR) + 1] == "/models/loras/team/a"
    assert "--enable-lora" in args and args[args.index("--max-loras") + 1] == "2"
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "models", "readOnly": True},
                      {"claimName": "loras", "readOnly": True}]  # fmt: skip
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/models/loras"]["readOnly"] is True
    assert adapter_claims(parse_spec(spec)) == ["loras"]


def test_a_claim_shared_with_the_model_or_adapters_is_mounted_once():
    adapters = [{"name": "sql", "source": "pvc://loras/sql"}]
    spec = spec_with("pvc://loras/more", adapters=adapters)
    pod = pod_of(spec)
    names = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
             if "persistentVolumeClaim" in v]  # fmt: skip
    assert names == ["models", "loras"]
    assert adapter_claims(parse_spec(spec)) == ["loras"]
    same = parse_spec(spec_with("pvc://models/adapters"))
    assert adapter_claims(same) == [] and plan_adapter_resolver(same) == (
        "/models/models/adapters",
        "models",
    )


def test_a_path_never_leaves_its_claim_and_a_container_path_mounts_nothing():
    escape = parse_spec(spec_with("pvc://loras/../../etc"))
    assert plan_adapter_resolver(escape) == ("/models/loras", "loras")
    local = spec_with("/mnt/adapters")
    args = args_of(local)
    assert args[args.index(LORA_RESOLVER_DIR) + 1] == "/mnt/adapters"
    assert adapter_claims(parse_spec(local)) == []


def test_without_a_resolver_the_template_is_unchanged():
    assert not any("lora" in a for a in args_of(spec_with(None)))
    with_lora = spec_with(None, engine={"enableLora": True})
    assert LORA_RESOLVER_DIR not in args_of(with_lora)
    # Only the flag and the mount differ from LoRA on without a resolver.
    plain = args_of(with_lora)
    resolver = args_of(spec_with("pvc://models/adapters", engine={"enableLora": True}))
    assert [a for a in resolver if a not in (LORA_RESOLVER_DIR, "/models/models/adapters")] == plain


def test_a_missing_claim_degrades_the_service_and_builds_nothing():
    kube = FakeKube()
    kube.pvcs.add("models")
    rec = Reconciler(OperatorConfig(server_image="default/img:1", admin_key=KEY), kube=kube)
    rec.reconcile(kube.add_isvc("chat", spec_with("pvc://loras/dir")))
    assert kube.children() == []
    status = kube.status("chat")
    assert conds(status)["Degraded"] == ("True", "AdapterSourceNotFound")
    assert "loras" in status["conditions"][2]["message"]
    kube.pvcs.add("loras")
    rec.reconcile_by_name(NS, "chat")  # the timer's next round
    assert ("Deployment", "chat") in kube.children()
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")
