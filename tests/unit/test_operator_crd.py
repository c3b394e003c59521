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
from batchpilot.operator import flags
from batchpilot.operator.crd import manifests
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec, SpecError, check_name, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


def test_committed_crds_are_generated_from_crd_py():
    files = manifests.rendered_files()
    assert set(files) == {p.name for p in CRDS.glob("*.yaml")}
    for name, text in files.items():
        assert (CRDS / name).read_text() == text, f"crds/{name} is stale: run `make crds`"


def test_cli_check_reports_stale_files(tmp_path, capsys):
    from batchpilot.cli import main

    assert main(["operator", "crds", "--output", str(tmp_path)]) == 0
    assert main(["operator", "crds", "--check", str(tmp_path)]) == 0
    (tmp_path / manifests.CRD_FILE).write_text("stale")
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
    m = manifests.crd_manifest()
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
    root = manifests.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = yaml.safe_dump(root)
    assert "$ref" not in text and "null" not in text and "title" not in text
    for path, node in _walk(root):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "type" in node, f"{path} has no type"
        assert "anyOf" not in node, path


def test_schema_bounds_and_enums():
    root = manifests.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
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

    aliases = {f.alias for f in EngineSpec.model_fields.values()}
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
        "scaleToZeroAfterSeconds": 300,
        "targetQueueLength": 4.0,
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300,
        "keda": {},
    }
    assert spec["tuning"]["maxNumSeqs"] == {"min": 8, "max": 256}
    assert spec["model"] == {"source": "bundled"}
    assert spec["replicas"] == 1
    # The CRD's default for spec is the same expansion.
    root = manifests.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
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
        (
            {"tuning": {"maxNumBatchedTokens": {"min": 4096, "max": 2048}}},
            "tuning.maxNumBatchedTokens.min must be <=",
        ),
        ({"tuning": {"maxNumBatchedTokens": {"max": 2048}}}, "maxNumBatchedTokens.min"),
        ({"tuning": {"maxNumBatchedTokens": {"min": 0, "max": 8}}}, "maxNumBatchedTokens.min"),
        (
            {"tuning": {"maxNumBatchedTokens": {"min": 1, "max": (1 << 20) + 1}}},
            "maxNumBatchedTokens.max",
        ),
        (
            {
                "tuning": {"maxNumBatchedTokens": {"min": 256, "max": 2048}},
                "engine": {"maxNumBatchedTokens": 4096},
            },
            "engine.maxNumBatchedTokens must lie within",
        ),
        (
            {
                "tuning": {"maxNumBatchedTokens": {"min": 1024, "max": 8192}},
                "engine": {"enableChunkedPrefill": False, "maxModelLen": 2048},
            },
            "tuning.maxNumBatchedTokens.min must be >= engine.maxModelLen",
        ),
        ({"slo": {"timeToFirstTokenSeconds": 0}}, "spec.slo.timeToFirstTokenSeconds"),
        ({"slo": {"timeToFirstTokenSeconds": 601}}, "spec.slo.timeToFirstTokenSeconds"),
        ({"slo": {"interTokenLatencySeconds": 61}}, "spec.slo.interTokenLatencySeconds"),
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


def test_step_budget_range_is_optional_and_bounds_the_engine():
    assert parse_spec({}).tuning.max_num_batched_tokens is None
    assert "maxNumBatchedTokens" not in parse_spec({}).to_api()["tuning"]
    spec = parse_spec(
        {
            "tuning": {"maxNumBatchedTokens": {"min": 2048, "max": 8192}},
            "engine": {
                "maxNumBatchedTokens": 4096,
                "enableChunkedPrefill": False,
                "maxModelLen": 2048,
            },
        }
    )
    r = spec.tuning.max_num_batched_tokens
    assert (r.min, r.max) == (2048, 8192)
    assert spec.to_api()["tuning"]["maxNumBatchedTokens"] == {"min": 2048, "max": 8192}
    root = manifests.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    tuning = root["properties"]["spec"]["properties"]["tuning"]
    assert tuning["properties"]["maxNumBatchedTokens"]["required"] == ["min", "max"]
    assert "maxNumBatchedTokens" not in tuning["default"]


def test_slo_targets_and_the_older_itl_field():
    spec = parse_spec({})
    assert spec.to_api()["slo"] == {"timeToFirstTokenSeconds": 2.0}
    assert (spec.ttft_target_seconds, spec.itl_target_seconds) == (2.0, 0.1)
    # tuning.targetInterTokenLatencySeconds still counts, unless spec.slo sets its own.
    spec = parse_spec({"tuning": {"targetInterTokenLatencySeconds": 0.25}})
    assert spec.itl_target_seconds == 0.25
    spec = parse_spec(
        {
            "slo": {"timeToFirstTokenSeconds": 0.5, "interTokenLatencySeconds": 0.05},
            "tuning": {"targetInterTokenLatencySeconds": 0.25},
        }
    )
    assert (spec.ttft_target_seconds, spec.itl_target_seconds) == (0.5, 0.05)


def test_name_rule():
    check_name("chat-1")
    for bad in ("1chat", "Chat", "chat_1", "a" * 64, "chat-"):
        with pytest.raises(SpecError, match="DNS-1035"):
            check_name(bad)


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


# --------------------------------------------------------------------------- hardening rules


@pytest.mark.parametrize(
    "arg",
    [
        "--max-num-seqs",
        "--max-num-seqs=9",
        "--max-num-seq=99999",  # an abbreviation
        "--max-num",  # a prefix of two managed flags
        "--admin-tok=x",
        "--admin-token",
        "--admin-port=9",
        "--port=1",
        "--no-enable-prefix-caching",
        "--no-enable-lora",  # LoRA off under the operator's adapters
        "--no-enable-lo",
        "--preload-lora-modules=[]",  # would override the operator's $BATCHPILOT_LORA_MODULES
        "--preload-lora",
        "--",  # would end the options: every managed flag starts with it
    ],
)
def test_extra_args_may_not_set_or_abbreviate_managed_flags(arg):
    assert flags.overrides_managed(arg)
    with pytest.raises(SpecError, match="may not set, or abbreviate"):
        parse_spec({"engine": {"extraArgs": ["--seed", "1", arg]}})


@pytest.mark.parametrize("arg", ["--seed", "3", "--kv-cache-memory", "2GiB", "--api-key=k", "-x"])
def test_extra_args_of_other_flags_and_values_pass(arg):
    assert not flags.overrides_managed(arg)
    parse_spec({"engine": {"extraArgs": [arg]}})


def test_no_other_server_flag_is_a_prefix_of_a_managed_one():
    """Refusing prefixes never refuses a real flag of `batchpilot serve`; and every managed
    flag is one of its flags."""
    import argparse

    from batchpilot.server.api.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server_flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert set(flags.MANAGED_FLAGS) <= server_flags
    for flag in server_flags - set(flags.MANAGED_FLAGS):
        assert not flags.overrides_managed(flag), flag


def test_every_flag_the_operator_sets_is_managed_and_so_is_its_negation(monkeypatch):
    """What the operator puts in a pod, everything on: each flag of its args; each flag whose
    default the variables it sets change (the flag would override them); and the other
    form of each boolean flag among them (--no-enable-lora turns --enable-lora off)."""
    import argparse

    from batchpilot.operator.children.build import build_children
    from batchpilot.operator.children.meta import Owner
    from batchpilot.server.api.cli import add_arguments

    spec = parse_spec(
        {
            "engine": {"maxNumSeqs": 8, "enablePrefixCaching": False, "maxLoras": 2},
            "adapters": [{"name": "sql", "source": "pvc://adapters/sql"}],
            "adapterResolver": {"source": "pvc://adapters/more"},
            "tuning": {"enabled": True},
            "resources": {"requests": {"cpu": "2"}},
        }
    )
    owner = Owner(name="chat", namespace="ns", uid="u")
    children = build_children(owner, spec, image="img", admin_token="t" * 32)
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]

    def server_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser

    before = {a.dest: a.default for a in server_parser()._actions}
    for env in c["env"]:
        monkeypatch.setenv(env["name"], "set-by-the-operator")
    parser = server_parser()
    by_env = {o for a in parser._actions if a.default != before[a.dest] for o in a.option_strings}
    in_args = {a.split("=")[0] for a in c["args"] if a.startswith("--")}
    assert "--preload-lora-modules" in by_env and flags.ENABLE_LORA in in_args
    set_by_operator = in_args | by_env
    both_forms = {
        o for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)
        if set(a.option_strings) & set_by_operator for o in a.option_strings
    }  # fmt: skip
    assert set_by_operator | both_forms <= set(flags.MANAGED_FLAGS)


@pytest.mark.parametrize("arg", ["--max-num-seq=99999", "--admin-tok=stolen", "--max-num-seq"])
def test_the_servers_parser_refuses_abbreviations(arg, capsys):
    """`batchpilot serve` parses with allow_abbrev=False: an abbreviation is an error (exit
    2), never the managed flag it abbreviates."""
    from batchpilot.cli import build_parser

    argv = ["serve", "--max-num-seqs", "8", arg]
    with pytest.raises(SystemExit) as e:
        build_parser(argv).parse_args(argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    ok = build_parser(["serve"]).parse_args(["serve", "--max-num-seqs", "8"])
    assert ok.max_num_seqs == 8


def test_every_parser_refuses_abbreviations():
    """The top-level parser and each subcommand's."""
    from batchpilot.cli import SUBCOMMANDS, build_parser

    for name in SUBCOMMANDS:
        parser = build_parser([name])
        assert parser.allow_abbrev is False
        sub = next(a for a in parser._actions if a.dest == "command")
        assert sub.choices[name].allow_abbrev is False, name


@pytest.mark.parametrize(
    "volume",
    [
        {"name": "h", "hostPath": {"path": "/"}},
        {"name": "n", "nfs": {"server": "x", "path": "/"}},
        {"name": "g", "gitRepo": {"repository": "x"}},
        {"name": "two", "configMap": {"name": "c"}, "secret": {"secretName": "s"}},
        {"name": "none"},  # what a pruned hostPath volume leaves
    ],
)
def test_pod_volumes_outside_the_restricted_list_are_refused(volume):
    with pytest.raises(SpecError, match="exactly one source, of configMap, csi"):
        parse_spec({"pod": {"volumes": [volume]}})


def test_pod_volumes_of_the_restricted_list_pass():
    volumes = [
        {"name": "c", "configMap": {"name": "c"}},
        {"name": "e", "emptyDir": {}},
        {"name": "p", "persistentVolumeClaim": {"claimName": "p"}},
        {"name": "s", "secret": {"secretName": "s"}},
    ]
    assert parse_spec({"pod": {"volumes": volumes}}).pod.volumes == volumes


def test_pod_spec_has_no_security_fields():
    """Privilege, host namespaces and capabilities are not expressible: the operator sets
    the security context, and spec.pod has no such field (the schema prunes, parse refuses)."""
    pod = manifests.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"
    ]["spec"]["properties"]["pod"]
    for field in ("securityContext", "hostNetwork", "hostPID", "hostIPC", "privileged"):
        assert field not in pod["properties"]
        with pytest.raises(SpecError):
            parse_spec({"pod": {field: True}})
