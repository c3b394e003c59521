"""The InferenceService schema: one Python source, a generated CRD that is structural and
committed up to date, and Python validation that agrees with the CRD's bounds and rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot import names
from batchpilot.operator import crd
from batchpilot.operator.crd import InferenceServiceSpec, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


def test_committed_crds_are_generated_from_crd_py():
    files = crd.rendered_files()
    assert set(files) == {p.name for p in CRDS.glob("*.yaml")}
    for name, text in files.items():
        assert (CRDS / name).read_text() == text, f"crds/{name} is stale: run `make crds`"


def test_cli_check_reports_stale_files(tmp_path, capsys):
    from batchpilot.cli import main

    assert main(["operator", "crds", "--output", str(tmp_path)]) == 0
    assert main(["operator", "crds", "--check", str(tmp_path)]) == 0
    (tmp_path / crd.CRD_FILE).write_text("stale")
    assert main(["operator", "crds", "--check", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().err


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_crd_shape():
    m = crd.crd_manifest()
    assert m["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = m["spec"]
    assert (spec["group"], spec["scope"]) == ("batchpilot.dev", "Namespaced")
    assert spec["names"]["shortNames"] == ["bpis"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["Ready", "Replicas", "MaxNumSeqs", "KV", "URL", "Age"]


def test_schema_is_structural():
    """Every node has a type (or is int-or-string / preserve-unknown), no $ref, no nulls."""
    root = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = yaml.safe_dump(root)
    assert "$ref" not in text and "null" not in text and "title" not in text
    for path, node in _walk(root):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "type" in node, f"{path} has no type"
        assert "anyOf" not in node, path


def test_schema_bounds_and_enums():
    root = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    engine = root["properties"]["spec"]["properties"]["engine"]["properties"]
    assert (engine["maxNumSeqs"]["minimum"], engine["maxNumSeqs"]["maximum"]) == (1, 4096)
    gmu = engine["gpuMemoryUtilization"]
    assert (gmu["minimum"], gmu["maximum"]) == (0.1, 0.99)
    assert engine["kvCacheDtype"]["enum"] == list(names.KV_CACHE_DTYPES)
    assert engine["preemptionMode"]["enum"] == list(names.PREEMPTION_MODES)
    rules = {r["rule"] for _, node in _walk(root) for r in node.get("x-kubernetes-validations", [])}
    assert "self.minReplicas <= self.maxReplicas" in rules
    assert "self.min <= self.max" in rules


def test_engine_fields_use_the_knob_names_and_server_defaults():
    """One name per knob: the CRD field is names.Knob.crd_field, the default the server's."""
    from batchpilot.server.config import EngineConfig

    aliases = {f.alias for f in crd.EngineSpec.model_fields.values()}
    knobs = [v for v in vars(names).values() if isinstance(v, names.Knob)]
    assert knobs
    for knob in knobs:
        assert knob.crd_field in aliases, knob
    server = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    spec = InferenceServiceSpec().engine
    for field in (
        "max_num_seqs",
        "block_size",
        "kv_cache_dtype",
        "preemption_mode",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "dtype",
        "gpu_memory_utilization",
    ):
        assert getattr(spec, field) == server[field], field
    assert spec.swap_space_gib * (1 << 30) == server["swap_space_bytes"]


def test_defaults_expand_like_the_api_server():
    spec = parse_spec({}).to_api()
    assert spec["engine"]["maxNumSeqs"] == 64
    assert spec["autoscaling"] == {
        "enabled": False,
        "mode": "builtin",
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueueLength": 4.0,
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300,
        "keda": {},
    }
    assert spec["tuning"]["maxNumSeqs"] == {"min": 8, "max": 256}
    assert spec["model"] == {"source": "bundled"}
    assert spec["replicas"] == 1
    # The CRD's default for spec is the same expansion.
    root = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    default = root["properties"]["spec"]["default"]
    assert default["engine"] == {k: v for k, v in spec["engine"].items() if v != []}


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
        ({"engine": {"maxNumSeqs": 4097}}, "spec.engine.maxNumSeqs"),
        ({"engine": {"gpuMemoryUtilization": 0.05}}, "gpuMemoryUtilization"),
        ({"engine": {"gpuMemoryUtilization": 1.0}}, "gpuMemoryUtilization"),
        ({"engine": {"kvCacheDtype": "int4"}}, "kvCacheDtype"),
        ({"engine": {"blockSize": 12}}, "blockSize"),
        ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must be <="),
        ({"autoscaling": {"mode": "keda"}}, "keda.serverAddress is required"),
        ({"autoscaling": {"mode": "knative"}}, "spec.autoscaling.mode"),
        ({"autoscaling": {"keda": {"serverAddress": "prometheus:9090"}}}, "serverAddress"),
        ({"tuning": {"maxNumSeqs": {"min": 64, "max": 8}}}, "min must be <="),
        (
            {
                "tuning": {"enabled": True, "maxNumSeqs": {"min": 8, "max": 32}},
                "engine": {"maxNumSeqs": 64},
            },
            "must lie within",
        ),
        (
            {
                "engine": {
                    "enableChunkedPrefill": False,
                    "maxModelLen": 4096,
                    "maxNumBatchedTokens": 2048,
                }
            },
            "maxNumBatchedTokens must be >= maxModelLen",
        ),
        ({"model": {"source": "s3://bucket/model"}}, "spec.model.source"),
        ({"resources": {"limits": {"cpu": []}}}, "spec.resources.limits"),
        ({"replicas": -1}, "spec.replicas"),
        ({"unknownField": 1}, "unknownField"),
    ],
)
def test_python_validation_rejects(spec, needle):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert needle in str(e.value)


def test_name_rule():
    crd.check_name("chat-1")
    for bad in ("1chat", "Chat", "chat_1", "a" * 64, "chat-"):
        with pytest.raises(SpecError, match="DNS-1035"):
            crd.check_name(bad)


_specs = st.fixed_dictionaries(
    {},
    optional={
        "replicas": st.integers(0, 1000),
        "engine": st.fixed_dictionaries(
            {},
            optional={
                "maxNumSeqs": st.integers(1, 4096),
                "kvCacheDtype": st.sampled_from(names.KV_CACHE_DTYPES),
                "gpuMemoryUtilization": st.floats(0.1, 0.99),
                "maxModelLen": st.integers(16, 1 << 20),
                "enablePrefixCaching": st.booleans(),
            },
        ),
        "autoscaling": st.integers(1, 1000).flatmap(
            lambda lo: st.fixed_dictionaries(
                {"minReplicas": st.just(lo), "maxReplicas": st.integers(lo, 1000)}
            )
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(_specs)
def test_valid_specs_round_trip(spec):
    parsed = parse_spec(spec)
    assert parse_spec(parsed.to_api()) == parsed
