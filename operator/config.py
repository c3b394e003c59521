"""The operator's one config object: the environment (BATCHPILOT_<FIELD>), overridden by
the flags of `batchpilot operator`."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from batchpilot import __version__

SERVER_IMAGE_REPOSITORY = "ghcr.io/batchpilot/batchpilot-server"
DEFAULT_SERVER_IMAGE = f"{SERVER_IMAGE_REPOSITORY}:{__version__}"
FIELD_MANAGER = "batchpilot-operator"
FINALIZER = "batchpilot.dev/operator"
ENV_PREFIX = "BATCHPILOT_"


class OperatorConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, use_attribute_docstrings=True
    )

    server_image: str = DEFAULT_SERVER_IMAGE
    """Image of InferenceServices that set no spec.image."""
    reconcile_interval: float = Field(30.0, gt=0)
    """Seconds between full reconciles of each InferenceService: drift in its children is
    corrected within this (deleted or edited Deployments, Services and PDBs sooner, on
    their watch events)."""
    cluster_domain: str = "cluster.local"
    """For status.url: http://<service>.<namespace>.svc.<cluster_domain>:<port>."""

    @classmethod
    def from_env(cls, **flags) -> OperatorConfig:
        """The environment, overridden by the flags that were given (None: not given)."""
        return cls(**{k: v for k, v in flags.items() if v is not None})


def env_var(field: str) -> str:
    """The environment variable of a field, e.g. BATCHPILOT_SERVER_IMAGE."""
    return ENV_PREFIX + field.upper()
