"""The deployed endpoint picker's EndpointPickerConfig (GIE v1.5.0's plugin types): its
scorers, their weights and the picker, from spec.routing.endpointPicker.scorers."""

from __future__ import annotations

import yaml

from batchpilot.operator.children.engine_args import KV_EVENTS_PORT
from batchpilot.operator.children.meta import Owner, selector_string
from batchpilot.operator.children.plan import lora_enabled
from batchpilot.operator.crd.routing import EndpointPickerSpec, PrefixCacheScorerSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec

CONFIG_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
CONFIG_KIND = "EndpointPickerConfig"
PROFILE = "default"
QUEUE_SCORER = "queue-scorer"
KV_CACHE_SCORER = "kv-cache-utilization-scorer"
LORA_SCORER = "lora-affinity-scorer"
PREFIX_SCORER = "prefix-cache-scorer"
# llm-d's inference scheduler (an EPP built on GIE's framework, with GIE's plugins too).
PRECISE_PREFIX_SCORER = "precise-prefix-cache-scorer"
# The highest total score wins, ties at random (GIE's default picker).
PICKER = "max-score-picker"
# llm-d's subscriber keeps the events whose topic starts so (engine_args.kv_events_args).
KV_TOPIC_FILTER = "kv@"


def approximate_parameters(prefix: PrefixCacheScorerSpec, block_size: int) -> dict:
    """GIE's approximate prefix index: sized from each pod's vllm:cache_config_info while
    autoTune is on, else from the engine's block size and the spec's capacity."""
    params: dict = {
        "autoTune": prefix.auto_tune,
        "maxPrefixBlocksToMatch": prefix.max_prefix_blocks,
    }
    if not prefix.auto_tune:
        params["blockSizeTokens"] = block_size
        params["lruCapacityPerServer"] = prefix.lru_capacity_per_server
    return params


def precise_parameters(owner: Owner, block_size: int) -> dict:
    """llm-d-kv-cache's indexer (its configuration.md at v0.9.0): one ZMQ subscriber per Ready
    server pod of this service (pod discovery, on KV_EVENTS_PORT), blocks of the engine's
    size so that its request keys match the events' tokens."""
    return {
        "tokenProcessorConfig": {"blockSize": block_size},
        "kvEventsConfig": {
            "topicFilter": KV_TOPIC_FILTER,
            "discoverPods": True,
            "podDiscoveryConfig": {
                "podLabelSelector": selector_string(owner.name),
                "podNamespace": owner.namespace,
                "socketPort": KV_EVENTS_PORT,
            },
        },
    }


def prefix_plugin(owner: Owner, spec: InferenceServiceSpec, epp: EndpointPickerSpec) -> dict:
    prefix = epp.scorers.prefix_cache
    block_size = spec.engine.block_size
    if prefix.mode == "precise":
        return {"type": PRECISE_PREFIX_SCORER, "parameters": precise_parameters(owner, block_size)}
    return {"type": PREFIX_SCORER, "parameters": approximate_parameters(prefix, block_size)}


def weighted_plugins(
    owner: Owner, spec: InferenceServiceSpec, epp: EndpointPickerSpec
) -> list[tuple[dict, int]]:
    """(plugin, weight) of every scorer with a weight above 0; LoRA affinity only with LoRA
    on (without adapters every pod scores the same)."""
    s = epp.scorers
    candidates = [
        ({"type": QUEUE_SCORER}, s.queue_weight),
        ({"type": KV_CACHE_SCORER}, s.kv_cache_utilization_weight),
        (prefix_plugin(owner, spec, epp), s.prefix_cache.weight),
        ({"type": LORA_SCORER}, s.lora_affinity_weight if lora_enabled(spec) else 0),
    ]
    return [(plugin, weight) for plugin, weight in candidates if weight > 0]


def picker_config(owner: Owner, spec: InferenceServiceSpec, epp: EndpointPickerSpec) -> dict:
    """The EndpointPickerConfig: the scorers, weighted in one profile, then the picker.
    The data layer (each pod's /metrics on the pool's port, vLLM's metric names) is GIE's
    default, which its loader adds when the config names none."""
    scorers = weighted_plugins(owner, spec, epp)
    return {
        "apiVersion": CONFIG_API_VERSION,
        "kind": CONFIG_KIND,
        "plugins": [plugin for plugin, _ in scorers] + [{"type": PICKER}],
        "schedulingProfiles": [
            {
                "name": PROFILE,
                "plugins": [{"pluginRef": p["type"], "weight": w} for p, w in scorers]
                + [{"pluginRef": PICKER}],
            }
        ],
    }


def render_config(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False)
