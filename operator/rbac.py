"""The permissions `batchpilot operator` needs, as ClusterRole rules (one source for the Helm
chart and the RBAC test, tests/integration/test_operator_cluster.py, which runs the operator
as a ServiceAccount bound to exactly these)."""

from __future__ import annotations

from batchpilot.operator.crd.api import GROUP, PLURAL

CHILD_VERBS = ["get", "list", "watch", "create", "patch", "update"]

RULES: list[dict] = [
    # The InferenceServices: kopf watches them, keeps its annotations and finalizer on them,
    # and the operator writes their status. Owner references with blockOwnerDeletion need
    # update on the finalizers subresource.
    {"apiGroups": [GROUP], "resources": [PLURAL],
     "verbs": ["get", "list", "watch", "patch", "update"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch", "update"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    # The children: read to check whose they are (ownership.py), created, or applied
    # server-side over the operator's own. Deployments, Services and ConfigMaps are also
    # the endpoint picker's, deleted when the spec stops asking for it (only the service's
    # own, checked by uid).
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": [*CHILD_VERBS, "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": [*CHILD_VERBS, "delete"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": CHILD_VERBS},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": [*CHILD_VERBS, "delete"]},
    # The endpoint picker's account and rights (routing.endpointPicker.deploy). The API
    # server lets the operator grant, in a Role, only what it holds itself (RBAC's
    # escalation check; no escalate or bind verb here): it holds each of the picker's
    # rules (children/picker.py PICKER_RULES, LEADER_ELECTION_RULES), as KServe's
    # controller holds its scheduler's.
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": [*CHILD_VERBS, "delete"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": [*CHILD_VERBS, "delete"]},
    {"apiGroups": ["inference.networking.x-k8s.io"],
     "resources": ["inferenceobjectives", "inferencemodelrewrites"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
    # The admin token's Secret: create only. The token is derived from the operator's key,
    # never read back; get, patch or update would let the operator read any Secret (a patch
    # answers with the whole object), create cannot read or change an existing one.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # The autoscaler the spec may ask for instead of the built-in one; removed when it no
    # longer does (only the operator's own, checked by uid).
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
     "verbs": [*CHILD_VERBS, "delete"]},
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": [*CHILD_VERBS, "delete"]},
    # The InferencePool the spec may ask for (Gateway API Inference Extension).
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": [*CHILD_VERBS, "delete"]},
    # Scale to zero: a Service at zero routes to the activator through an EndpointSlice of
    # the operator's (its own only, checked by uid), made from the activator Service's.
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": [*CHILD_VERBS, "delete"]},
    # The model cache's fill Jobs (spec.model.cache): watched for their end; one left from
    # an earlier source or image is deleted (only the service's own, checked by uid).
    # Never patched: a Job's pod template cannot change, a new one is a new Job.
    {"apiGroups": ["batch"], "resources": ["jobs"],
     "verbs": ["get", "list", "watch", "create", "delete"]},
    # The closed loop scrapes the Ready pods of each service; watch only for the endpoint
    # picker's Role, which grants it.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    # Checked before building: the model's claim and the pods' ServiceAccount exist (get on
    # ServiceAccounts is above, with the picker's). A model
    # cache's claim is created when absent, and never changed or deleted: no patch, update
    # or delete.
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create"]},
    # Events on the InferenceServices.
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # Kopf: peering between replicas, namespace globs, and discovery of the CRDs it serves.
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings", "clusterkopfpeerings"],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["get", "list", "watch"]},
]  # fmt: skip


# The activator's (`batchpilot activator`, operator/activator/kube.py), and nothing more. The
# chart binds these to its own ServiceAccount: with a ClusterRole when it serves every
# namespace, with a Role in each served namespace otherwise (`--namespace`, watchNamespaces).
ACTIVATOR_PERMISSIONS: list[dict] = [
    # Asking for a replica: a JSON merge patch of one annotation,
    # batchpilot.dev/wake-requested-at. RBAC cannot scope a patch to a field, so the chart's
    # ValidatingAdmissionPolicy (templates/activator-admission.yaml) denies the activator any
    # other change. No get, list or watch: it never reads an InferenceService.
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["patch"]},
    # Which InferenceService a request is for, and whether the operator routes its Service
    # here: a watch (list, then watch) of the operator's EndpointSlices (label
    # endpointslice.kubernetes.io/managed-by=batchpilot-operator) and Services (label
    # app.kubernetes.io/managed-by=batchpilot-operator).
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
    # A service's Ready pods, and a client pod's namespace from its IP (fieldSelector
    # status.podIP). Listed, never read one by one.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]  # fmt: skip


def cluster_role(name: str = "batchpilot-operator") -> dict:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": RULES,
    }
