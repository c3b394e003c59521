"""The operator's one config object: flags of `batchpilot operator`, or the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from batchpilot import __version__

SERVER_IMAGE_REPOSITORY = "ghcr.io/batchpilot/batchpilot-server"
DEFAULT_SERVER_IMAGE = f"{SERVER_IMAGE_REPOSITORY}:{__version__}"
FIELD_MANAGER = "batchpilot-operator"
FINALIZER = "batchpilot.dev/operator"

# field -> environment variable (flags override these)
ENV = {
    "server_image": "BATCHPILOT_SERVER_IMAGE",
    "reconcile_interval": "BATCHPILOT_RECONCILE_INTERVAL",
    "cluster_domain": "BATCHPILOT_CLUSTER_DOMAIN",
}


@dataclass(frozen=True)
class OperatorConfig:
    server_image: str = DEFAULT_SERVER_IMAGE
    """Image of InferenceServices that set no spec.image."""
    reconcile_interval: float = 30.0
    """Seconds between full reconciles of each InferenceService: drift in its children is
    corrected within this (deleted or edited Deployments, Services and PDBs sooner, on
    their watch events)."""
    cluster_domain: str = "cluster.local"
    """For status.url: http://<service>.<namespace>.svc.<cluster_domain>:<port>."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> OperatorConfig:
        env = os.environ if env is None else env
        values: dict = {}
        for f in fields(cls):
            raw = env.get(ENV[f.name], "").strip()
            if raw:
                values[f.name] = float(raw) if f.type in (float, "float") else raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        if config.reconcile_interval <= 0:
            raise ValueError("reconcile_interval must be > 0")
        return config
