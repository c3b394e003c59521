"""The status refresh from a Deployment's events, a part of reconcile.Reconciler: replicas
and conditions only, from the Deployment as it is when the refresh runs.

The events are merged (coalesce.py). A change of Ready (the Deployment now has as many
replicas ready as it wants, or no longer has) is written within ``refresh_delay`` (1 s);
the ready count on its way (0, 1, ... 5 while a service starts) within COUNT_DELAY. While
1,000 services were made, each event was a read of the service, a read of the Deployment
and a status patch when anything moved: 4 refreshes a service, most of them between.
"""

from __future__ import annotations

from batchpilot.operator import ownership, status
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.crd.spec import SpecError, parse_spec

READY_DELAY = 1.0  # a change of Ready is written this soon after its event
COUNT_DELAY = 10.0  # the replica counts between: at most this late


class StatusRefresh:
    """Reconciler's refresh; the Reconciler gives it kube, _lock, _to_activator, _picker,
    _refreshes (a Coalescer of _refresh_later) and _ready_shown (what status says of Ready
    as this process last computed it, by service)."""

    def _request_refresh(self, owner: tuple[str, str], dep: dict) -> None:
        view = status.DeploymentView.of(dep)
        ready = status.ready(view, None, self._to_activator.get(owner, False))[0]
        urgent = self._ready_shown.get(owner) != ready
        delay = self._refreshes.delay if urgent else max(self._refreshes.delay, COUNT_DELAY)
        self._refreshes.request(owner, dep, delay)

    def _shown(self, ns: str, name: str, new: dict) -> None:
        ready = status.find_condition(new, status.READY) or {}
        self._ready_shown[(ns, name)] = ready.get("status") == "True"

    def _refresh_later(self, owner: tuple[str, str], dep: dict) -> None:
        with self._lock(*owner):  # what a Deployment's events asked for (the latest's copy)
            self._refresh_status(*owner, dep)

    def _refresh_status(self, ns: str, name: str, dep: dict, *, picker: bool = False) -> None:
        """Status from a Deployment event (the server's, or with ``picker`` the endpoint
        picker's): replicas and conditions only; a spec problem found by the last reconcile
        of this generation is kept, and so is the picker's failure on a server event."""
        body = self.kube.read_isvc(ns, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        if not ownership.controlled_by(dep, Owner.from_body(body)):
            return  # an earlier object's of that name, being garbage-collected
        # The Deployment as it is now, not as the event saw it: on a busy operator an event
        # can be handled after a reconcile wrote a newer status, and its older counts would
        # take Ready and the replica counts back (a loaded test run saw both). The read also
        # skips the states between: the watch's own copy instead (no read) wrote each one,
        # 7,548 status patches against 5,039 while 1,000 services were made
        # (benchmarks/results/operator-scale-20261206-watch-copy-reverted.json).
        dep = self.kube.read("apps/v1", "Deployment", ns, name) or (None if picker else dep)
        prev = body.get("status") or {}
        # The generation last reconciled, not the object's: an edit not yet applied must not
        # read as observed (nor lose its reconcile's "Applied" event).
        generation = prev.get("observedGeneration")
        if generation is None:
            return  # never reconciled: the reconcile writes the first status
        new = status.compute_status(
            name=name,
            generation=generation,
            prev=prev,
            deployment=dep,
            problem=status.kept_problem(prev, generation),
            url=prev.get("url"),
            to_activator=self._to_activator.get((ns, name), False),
            cache=status.kept_cache(prev),
            picker_failed=self._picker_failure(body)
            if picker
            else status.kept_picker_failure(prev, generation),
        )
        if any(prev.get(k) != v for k, v in new.items()):
            self.kube.patch_isvc_status(ns, name, new)
        self._shown(ns, name, new)

    def _picker_failure(self, body: dict) -> str | None:
        """The failure of the picker the spec deploys now (not of one being deleted)."""
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return None
        return status.picker_failure(self._picker(Owner.from_body(body), spec))
