"""The Deployment that runs the server pods, and the PodDisruptionBudget that guards them."""

from __future__ import annotations

import json

from batchpilot.operator.children.engine_args import ANN_ENGINE, engine_settings
from batchpilot.operator.children.meta import Owner, child_metadata, selector_labels
from batchpilot.operator.children.plan import desired_replicas, effective_engine, start_engine
from batchpilot.operator.children.pod import build_pod_template
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.state import LoopState


def build_deployment(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    image: str,
    admin_token: str,
    loops: LoopState = LoopState(),
) -> dict:
    engine = start_engine(spec, effective_engine(spec, loops))
    applied = json.dumps(engine_settings(engine), sort_keys=True, separators=(",", ":"))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, owner.name, {ANN_ENGINE: applied}),
        "spec": {
            "replicas": desired_replicas(spec, loops),
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": 1200,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": build_pod_template(owner, spec, engine, image, admin_token),
        },
    }


def build_pdb(owner: Owner) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, owner.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
            # A pod that never became ready may be evicted: it serves nothing.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
