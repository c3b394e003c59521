"""The ConfigMap new pods read without a rollout: the tuned max_num_seqs and the adapters."""

from __future__ import annotations

import json

from batchpilot import names
from batchpilot.operator.children.meta import Owner, child_metadata
from batchpilot.operator.children.plan import lora_enabled, plan_adapters, tuned_step_budget
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec

# spec.adapters reach new pods through this ConfigMap key (--preload-lora-modules' variable):
# a new replica starts serving them, and a change of the list rolls nothing (running pods
# get it through their admin API).
LORA_MODULES_KEY = "lora-modules"


def config_map_name(name: str) -> str:
    return f"{name}-engine"


def build_config_map(owner: Owner, spec: InferenceServiceSpec, engine: EngineSpec) -> dict:
    """What new pods read without a rollout: the tuner's max_num_seqs and the adapters to
    start with; a tuned max_num_batched_tokens is only recorded, for humans (pods start at
    the range's max and the loop sets it live)."""
    data = {names.MAX_NUM_SEQS.name: str(engine.max_num_seqs)}
    if tuned_step_budget(spec) is not None:
        data[names.MAX_NUM_BATCHED_TOKENS.name] = str(engine.max_num_batched_tokens)
    if lora_enabled(spec):
        modules = [{"name": a.name, "path": a.path} for a in plan_adapters(spec)]
        data[LORA_MODULES_KEY] = json.dumps(modules, separators=(",", ":"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, config_map_name(owner.name)),
        "data": data,
    }
