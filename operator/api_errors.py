"""Which API errors retrying the same spec will not fix, as the status Problem they are."""

from __future__ import annotations

import json

from batchpilot.operator import status
from batchpilot.operator.kube import ApiException
from batchpilot.operator.status import Problem

# 422: the API server rejected a child built from the spec; 400/403: a malformed request or
# missing RBAC. Anything else (409 on a concurrent change, 5xx, timeouts) is retried by kopf.
PERMANENT_APPLY_STATUSES = {
    422: status.INVALID_SPEC,
    400: status.APPLY_FAILED,
    403: status.APPLY_FAILED,
}


def api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body or "{}").get("message") or str(e.reason)
    except (ValueError, AttributeError):
        return f"{e.status} {e.reason}"


def permanent_problem(e: ApiException) -> Problem | None:
    """The problem a refused write is, or None when kopf is to retry it."""
    reason = PERMANENT_APPLY_STATUSES.get(e.status)
    if reason is None:
        return None
    return Problem(reason, f"the API server rejected a child: {api_message(e)}")
