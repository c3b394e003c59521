"""Every child of an InferenceService, in apply order, and which optional kinds to delete."""

from __future__ import annotations

from batchpilot.operator.children.autoscaler import (
    HPA_KIND,
    SCALED_OBJECT_KIND,
    autoscaler_children,
    autoscaler_kind,
)
from batchpilot.operator.children.config_map import build_config_map
from batchpilot.operator.children.deployment import build_deployment, build_pdb
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.picker import picker_children
from batchpilot.operator.children.plan import effective_engine
from batchpilot.operator.children.pool import INFERENCE_POOL_KIND, build_inference_pool
from batchpilot.operator.children.secret import build_secret
from batchpilot.operator.children.service import (
    ENDPOINT_SLICE_KIND,
    Activator,
    build_activator_slice,
    build_service,
)
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.state import LoopState


def optional_kinds(spec: InferenceServiceSpec) -> list[tuple[str, str]]:
    """(apiVersion, kind) of the children beyond the core ones that the spec asks for: CRDs
    the cluster may not serve."""
    kinds = [autoscaler_kind(spec)]
    if spec.routing.inference_pool:
        kinds.append(INFERENCE_POOL_KIND)
    return [k for k in kinds if k is not None]


def optional_children(owner: Owner, spec: InferenceServiceSpec) -> list[dict]:
    pool = [build_inference_pool(owner, spec)] if spec.routing.inference_pool else []
    return [*autoscaler_children(owner, spec), *pool]


def stale_kinds(spec: InferenceServiceSpec, *, to_activator: bool = False) -> list[tuple[str, str]]:
    """(apiVersion, kind) of optional children not asked for now: any left from an earlier
    spec (or, for the activator's EndpointSlice, from the time at zero) are deleted."""
    wanted = [*optional_kinds(spec), *([ENDPOINT_SLICE_KIND] if to_activator else [])]
    optional = (HPA_KIND, SCALED_OBJECT_KIND, INFERENCE_POOL_KIND, ENDPOINT_SLICE_KIND)
    return [k for k in optional if k not in wanted]


def build_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    image: str,
    admin_token: str,
    loops: LoopState = LoopState(),
    activator: Activator | None = None,
) -> list[dict]:
    """Every child, in apply order: what the Deployment reads (Secret, ConfigMap) before it,
    what scales or routes to it after it, the endpoint picker last (it waits for its
    pool). ``activator``: given only while the Service
    routes there (routes_to_activator)."""
    engine = effective_engine(spec, loops)
    slice_ = [build_activator_slice(owner, activator)] if activator else []
    return [
        build_secret(owner, admin_token),
        build_config_map(owner, spec, engine),
        *slice_,
        build_service(owner, to_activator=activator is not None),
        build_pdb(owner),
        build_deployment(owner, spec, image=image, admin_token=admin_token, loops=loops),
        *optional_children(owner, spec),
        *picker_children(owner, spec),
    ]
