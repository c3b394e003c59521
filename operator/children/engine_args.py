"""The engine's settings as the server's flags, and as the record the Deployment keeps of
them (its ANN_ENGINE annotation, which status reads back)."""

from __future__ import annotations

import json

from batchpilot import names
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.flags import (
    BOOL_KNOBS,
    ENABLE_LORA,
    ENGINE_KNOBS,
    KV_EVENTS_CONFIG,
    LORA_KNOBS,
)

# The engine settings the operator applied (JSON, on the Deployment's own metadata: a
# change of it alone never rolls the pods).
ANN_ENGINE = "batchpilot.dev/engine"

# While the tuner is on, max_num_seqs reaches new pods through this variable, read from the
# service's ConfigMap: a tuned value changes the ConfigMap, never the pod template, so it
# rolls nothing (running pods get it live through /admin/config).
MAX_NUM_SEQS_ENV = "BATCHPILOT_MAX_NUM_SEQS"

# The KV-cache events' PUB socket on each server pod (vLLM's default endpoint), where the
# deployed picker's precise prefix scorer subscribes; POD_IP_ENV names the pod in the topic.
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_NAME = "kv-events"
POD_IP_ENV = "POD_IP"


def _field(knob: names.Knob) -> str:
    """EngineSpec's attribute for a knob (the spec states swap space in GiB)."""
    return "swap_space_gib" if knob is names.SWAP_SPACE else knob.name


def _num(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def engine_knobs(engine: EngineSpec) -> tuple[names.Knob, ...]:
    """The knobs a pod template sets: LoRA's only with LoRA on, so that a service without
    adapters keeps its template (and its pods) across an operator upgrade."""
    return (*ENGINE_KNOBS, *LORA_KNOBS) if engine.enable_lora else ENGINE_KNOBS


def engine_args(engine: EngineSpec, *, live_max_num_seqs: bool = False) -> list[str]:
    """The engine flags; with ``live_max_num_seqs`` (the tuner on) --max-num-seqs reads the
    ConfigMap-backed variable, which Kubernetes expands in args. The adapters themselves are
    never flags (no --lora-modules): new pods read them from the ConfigMap and running ones
    get them through their admin API, so adding or removing one never changes the
    template."""
    args = ["--dtype", engine.dtype] + ([ENABLE_LORA] if engine.enable_lora else [])
    for knob in engine_knobs(engine):
        value = getattr(engine, _field(knob))
        if value is None:
            continue
        if knob is names.MAX_NUM_SEQS and live_max_num_seqs:
            args.append(f"{knob.flag}=$({MAX_NUM_SEQS_ENV})")
        elif knob.name in BOOL_KNOBS:
            args.append(knob.flag if value else "--no-" + knob.flag[2:])
        else:
            args += [knob.flag, value if isinstance(value, str) else _num(value)]
    return args


def engine_settings(engine: EngineSpec) -> dict:
    """The engine settings a pod template puts in force, camelCase like status.engine: what
    the Deployment records in its ANN_ENGINE annotation and status reads back."""
    out = {}
    for knob in engine_knobs(engine):
        value = getattr(engine, _field(knob))
        if value is not None:
            out[knob.crd_field] = value
    return out


def read_engine_settings(deployment: dict) -> dict:
    """The settings a live Deployment records (empty when it records none or garbage: the
    next apply writes the annotation back)."""
    raw = (deployment.get("metadata", {}).get("annotations") or {}).get(ANN_ENGINE, "")
    try:
        settings = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return settings if isinstance(settings, dict) else {}


def kv_events_args(served_name: str) -> list[str]:
    """--kv-events-config for the picker's precise prefix scorer: bound on every interface
    (llm-d's pod discovery connects to each pod), with the topic llm-d parses as
    kv@<pod>@<model>; its pod is the address the scorer knows the endpoint by, <ip>:<port>
    (llm-d-kv-cache's architecture.md). Kubernetes expands $(POD_IP) from the env."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "topic": f"kv@$({POD_IP_ENV}):{names.DEFAULT_PORT}@{served_name}",
    }
    return [KV_EVENTS_CONFIG, json.dumps(config, separators=(",", ":"))]
