"""An in-memory stand-in for the operator's Kube (operator/kube.py) and a metrics source
with a long queue: the reconcile shell's unit tests run against them. The real API server
is in tests/integration/test_operator_cluster.py."""

from __future__ import annotations

import copy
import itertools
import json

from batchpilot.operator.children.pod import LABEL_SA_ALLOWED
from batchpilot.operator.kube import ApiException

NS = "team-a"
KEY = "operator-key-3f9a-0123456789abcdef"  # config.MIN_ADMIN_KEY_CHARS or more


def conflict(message: str) -> ApiException:
    e = ApiException(status=409, reason="Conflict")
    e.body = json.dumps({"message": message})
    return e


class FakeKube:
    field_manager = "batchpilot-operator"

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.calls: list[tuple] = []
        self.pvcs: set[str] = set()
        self.service_accounts: set[str] = {"default", "plain"}
        self.allowed_accounts: set[str] = {"default"}
        self.reject: dict[str, ApiException] = {}  # kind -> error on (dry-run) writes
        self.unserved: set[str] = {"ScaledObject"}  # kinds the API server does not serve (KEDA)
        self._versions = itertools.count(100)

    def add_isvc(self, name: str, spec: dict, generation: int = 1) -> dict:
        body = {
            "apiVersion": "batchpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": f"uid-{name}",
                "generation": generation,
            },
            "spec": spec,
        }
        self.objects[("InferenceService", NS, name)] = body
        return body

    def put(self, obj: dict) -> dict:
        """Store an object as the API server would: a uid and a new resourceVersion."""
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        meta.setdefault("namespace", NS)
        meta.setdefault("uid", f"uid-{obj['kind']}-{meta['name']}-{next(self._versions)}")
        meta["resourceVersion"] = str(next(self._versions))
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = new
        return copy.deepcopy(new)

    def _write(self, verb: str, obj: dict, dry_run: bool) -> dict:
        self.calls.append((verb, obj["kind"], obj["metadata"]["name"], dry_run))
        if obj["kind"] in self.reject:
            raise self.reject[obj["kind"]]
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        old = self.objects.get(key)
        new = copy.deepcopy(obj)
        if old is not None:
            new["metadata"]["uid"] = old["metadata"]["uid"]
            if "managedFields" in old["metadata"]:  # others' entries stay
                new["metadata"]["managedFields"] = old["metadata"]["managedFields"]
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        changed = old is None or old.get("spec") != obj.get("spec")
        new["metadata"]["generation"] = gen + 1 if changed else gen
        return copy.deepcopy(new) if dry_run else self.put(new)

    def create(self, obj: dict, *, dry_run: bool = False) -> dict:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            self.calls.append(("create", obj["kind"], obj["metadata"]["name"], dry_run))
            raise conflict("already exists")
        return self._write("create", obj, dry_run)

    def apply(self, obj: dict, *, dry_run: bool = False) -> dict:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        live = self.objects.get(key)
        pinned = obj["metadata"].get("resourceVersion")
        assert pinned, "an apply is always pinned to the version that was checked"
        if live is None or live["metadata"]["resourceVersion"] != pinned:
            self.calls.append(("apply", obj["kind"], obj["metadata"]["name"], dry_run))
            raise conflict("the object has been modified")
        return self._write("apply", obj, dry_run)

    def replace(self, obj: dict) -> dict:
        self.calls.append(("replace", obj["kind"], obj["metadata"]["name"]))
        return self.put(obj)

    def serves(self, api_version, kind):
        return kind not in self.unserved

    def delete(self, api_version, kind, namespace, name, preconditions, propagation=None):
        assert self.serves(api_version, kind)
        self.calls.append(("delete", kind, name))
        live = self.objects.get((kind, namespace, name))
        if live is None:
            return False
        if {k: live["metadata"][k] for k in preconditions} != preconditions:
            raise conflict("precondition failed")
        del self.objects[(kind, namespace, name)]
        return True

    def read(self, api_version, kind, namespace, name):
        self.calls.append(("read", kind, name))
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def list(self, api_version, kind, namespace, label_selector):
        self.calls.append(("list", kind, label_selector))
        want = dict(term.split("=", 1) for term in label_selector.split(","))
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.objects.items()
            if k == kind
            and ns == namespace
            and want.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    def read_isvc(self, namespace, name):
        return copy.deepcopy(self.objects.get(("InferenceService", namespace, name)))

    def patch_isvc_status(self, namespace, name, status):
        self.calls.append(("status", name))
        body = self.objects[("InferenceService", namespace, name)]
        body["status"] = {**body.get("status", {}), **copy.deepcopy(status)}

    def pvc_exists(self, namespace, name):
        return name in self.pvcs

    def read_service_account(self, namespace, name):
        labels = {LABEL_SA_ALLOWED: "allowed"} if name in self.allowed_accounts else {}
        return (
            {"metadata": {"name": name, "labels": labels}}
            if name in self.service_accounts
            else None
        )

    def children(self) -> list[tuple[str, str]]:
        return sorted((k, n) for (k, _, n) in self.objects if k != "InferenceService")

    def status(self, name: str) -> dict:
        return self.objects[("InferenceService", NS, name)].get("status", {})


def metrics_text(waiting: int, running: int, max_num_seqs: int) -> str:
    """A batchpilot server's /metrics, reduced to what the loop reads."""
    lines = []
    for name, value in (
        ("vllm:num_requests_waiting", waiting),
        ("vllm:num_requests_running", running),
        ("vllm:num_requests_swapped", 0),
        ("vllm:kv_cache_usage_perc", 0.2),
        ("batchpilot:max_num_seqs", max_num_seqs),
    ):
        lines += [f"# TYPE {name} gauge", f'{name}{{model_name="m"}} {value}']
    return "\n".join(lines) + "\n"


class QueuedSource:
    """Two replicas with a long queue: what a real overloaded service reports."""

    async def scrape(self, namespace, name):
        from batchpilot.operator.loop.scrape import Scrape

        text = metrics_text(waiting=20, running=8, max_num_seqs=8)
        return [
            Scrape(f"http://10.0.0.{i}:8000", text=text, admin_url=f"http://10.0.0.{i}:8001")
            for i in (1, 2)
        ]


def conds(st: dict) -> dict:
    """A status's conditions as type -> (status, reason)."""
    return {c["type"]: (c["status"], c["reason"]) for c in st.get("conditions", [])}
