"""The operator's one config object: the environment (BATCHPILOT_<FIELD>), overridden by
the flags of `batchpilot operator`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from batchpilot import __version__
from batchpilot.operator.shard import SHARD_PATTERN, Shard

SERVER_IMAGE_REPOSITORY = "ghcr.io/batchpilot/batchpilot-server"
DEFAULT_SERVER_IMAGE = f"{SERVER_IMAGE_REPOSITORY}:{__version__}"
FIELD_MANAGER = "batchpilot-operator"
FINALIZER = "batchpilot.dev/operator"
ENV_PREFIX = "BATCHPILOT_"
# Each admin token is an HMAC of this key and its object's identity, and a tenant can read
# its own token (the Secret in its namespace): a short key could be found offline from one
# token, and every other tenant's token made from it. 32 characters of the chart's
# alphabet (62 letters and digits) are over 190 bits; the chart generates 48.
MIN_ADMIN_KEY_CHARS = 32


class OperatorConfig(BaseSettings):
    # hide_input_in_errors: a refused admin_key must not appear in the error (or the log).
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, use_attribute_docstrings=True, hide_input_in_errors=True
    )

    server_image: str = DEFAULT_SERVER_IMAGE
    """Image of InferenceServices that set no spec.image."""
    reconcile_interval: float = Field(30.0, gt=0)
    """Seconds between checks of each InferenceService. A check is a full reconcile when
    the last one found a problem (a missing claim may have appeared), the Service routes
    to the activator, or resync_interval has passed; otherwise it reads and writes
    nothing: edits of the object, and deleted or edited Deployments, Services, ConfigMaps
    and PDBs, are reconciled at once on their watch events."""
    resync_interval: float = Field(600.0, gt=0)
    """Seconds between full reconciles of a service whose last one found nothing wrong:
    every child is read and applied again (drift in the kinds not watched: Secret,
    autoscaler, InferencePool). Each service's period is stretched by up to a tenth, by a
    hash of its name, so services made together do not resync together."""
    cluster_domain: str = "cluster.local"
    """For status.url: http://<service>.<namespace>.svc.<cluster_domain>:<port>."""
    loop_interval: float = Field(15.0, gt=0)
    """Seconds between two rounds of the closed loop (scrape, decide, apply) of each
    InferenceService with autoscaling or tuning enabled."""
    status_interval: float = Field(60.0, gt=0)
    """Seconds between writes of the loop's figures (status.metrics, the tuner's model and
    tallies) while nothing is decided: a decision, a scale change or a condition flipping
    is written in the turn that makes it."""
    metrics_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Replica base URLs (http://host:port) the loop scrapes and tunes instead of the
    service's Ready pods, for every InferenceService: servers outside the cluster, tests.
    Comma-separated in the environment."""
    admin_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """The admin API's base URL of each of metrics_urls, in the same order. Default: each
    metrics URL's host on the admin port (8001)."""
    admin_key: SecretStr | None = None
    """The key every service's admin token is derived from (HMAC of the key and the
    object's namespace, name and uid). Environment only (BATCHPILOT_ADMIN_KEY, from a
    Secret: the chart's), never a flag; at least MIN_ADMIN_KEY_CHARS characters. Unset: a
    random key per process."""
    activator_service: str | None = Field(None, pattern=r"^[a-z0-9-]+/[a-z0-9-]+$")
    """<namespace>/<name> of the activator's Service (the chart's). An InferenceService
    with autoscaling.minReplicas 0 routes its Service there while no replica is Ready (at
    zero, and while the first one starts): requests are held, not refused. Unset: a
    service at zero refuses connections until it is scaled up."""
    liveness: str | None = None
    """Serve /healthz (liveness) and /metrics (the operator's own metrics) at this URL's
    host and port, e.g. http://0.0.0.0:8080/healthz."""
    peering_lifetime: int = Field(20, ge=10, le=600)
    """Seconds this replica's peering entry lives unrenewed (kopf renews it 5-10 s sooner):
    how long a standby waits before it takes over from a replica that died without leaving.
    Kopf's own default, 60, left a crash a minute without an operator."""
    shard: str | None = Field(None, pattern=SHARD_PATTERN)
    """I/N: handle only the InferenceServices whose sha256("namespace/name") mod N is I
    (shard.py); run one Deployment per I, each with its own peering. Unset: all."""

    @field_validator("shard")
    @classmethod
    def _shard_in_range(cls, value: str | None) -> str | None:
        Shard.parse(value)  # the index lies in 0..N-1
        return value

    @field_validator("metrics_urls", "admin_urls", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("admin_key")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(
                f"{env_var('admin_key')} is shorter than {MIN_ADMIN_KEY_CHARS} characters: a "
                "tenant could find it from its own admin token (the chart's random key has 48)"
            )
        return value

    @model_validator(mode="after")
    def _paired(self) -> OperatorConfig:
        if self.admin_urls and len(self.admin_urls) != len(self.metrics_urls):
            raise ValueError("admin_urls must name one URL per metrics URL")
        return self

    @classmethod
    def from_env(cls, **flags) -> OperatorConfig:
        """The environment, overridden by the flags that were given (None: not given)."""
        return cls(**{k: v for k, v in flags.items() if v is not None})


def env_var(field: str) -> str:
    """The environment variable of a field, e.g. BATCHPILOT_SERVER_IMAGE."""
    return ENV_PREFIX + field.upper()


def describe(error: ValidationError) -> str:
    """A refused configuration in one line, each problem with its field, never with the
    value given (the admin key's)."""
    return "; ".join(
        ": ".join([*map(str, e["loc"]), e["msg"].removeprefix("Value error, ")])
        for e in error.errors(include_input=False, include_url=False)
    )
