"""The loop's status between writes: what its turns left, and when to write it.

A turn's status patch (metrics, tuning, autoscaling) differs every turn: window figures,
timestamps, the model's fit. Writing each one costs the API server a write per service per
turn (a thousand services at the 15 s default: 4,000 writes a minute, each an event for
every watcher of the object). So a turn writes at once only its milestones, what others
act on or read as a decision: the settings and replicas the reconcile builds from, an
experiment begun or ended, a verdict, a scale decision or hold, the loop going blind, the
plant's condition flipping, anything it posted an Event about. The rest is held here, is
what the next turn starts from, and is written at most every ``status_interval`` seconds,
and not while the service rolls out (Progressing): the reconcile writes status then, as
replicas come up, and a rollout's windows are no figures to read. With 1,000 services made
together this cut the status patches made before all were Ready from 5,660 to 5,040 and
5,230 (two runs), each one an event the operator's own watch then processed. A rollout
ends, or its progress deadline ends it, so the figures wait a bounded time. A standby
that takes over reads what was written: it loses at most that much of the windows'
figures, never a decision.

Whose status a turn starts from: its own held one while the object's loop keys are one of
this process's recent writes; anyone else's write to them (another operator replica that
was active meanwhile, a person clearing a field) wins, the held figures are dropped and
the next turn writes at once.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.status import PROGRESSING, find_condition, plant_degraded

LOOP_KEYS = ("metrics", "tuning", "autoscaling")
_WRITES_KEPT = 8  # own writes a lagging watch may still show


def merge_patch(target: dict, patch: dict) -> dict:
    """``target`` with a JSON merge patch applied (RFC 7386): None removes a key."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            base = out.get(key)
            out[key] = merge_patch(base if isinstance(base, dict) else {}, value)
        else:
            out[key] = value
    return out


def compose(first: dict, second: dict) -> dict:
    """One merge patch that does what ``first`` then ``second`` do."""
    out = dict(first)
    for key, value in second.items():
        base = out.get(key)
        both = isinstance(value, dict) and isinstance(base, dict)
        out[key] = compose(base, value) if both else value
    return out


def fingerprint(status: dict) -> str:
    """The loop keys of a status, as the API server gives them back: a float with no
    fraction comes back as an integer, a null as no key."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    loop = {k: status[k] for k in LOOP_KEYS if k in status}
    return json.dumps(plain(loop), sort_keys=True)


def reconcile_inputs(status: dict, now: float) -> tuple:
    """What the reconcile builds from in the loop's status: the decisions the children
    carry, and the loop's conditions (LoopBlind, PlantDegraded)."""
    return (
        LoopState.from_status(status),
        bool((status.get("metrics") or {}).get("loopBlind")),
        plant_degraded(status, now),
    )


def milestones(status: dict, now: float) -> tuple:
    """What in the loop's status others act on or read as a decision."""
    tuning = status.get("tuning") or {}
    experiment = tuning.get("experiment") or {}
    history = tuning.get("history") or [{}]
    scaling = status.get("autoscaling") or {}
    return (
        *reconcile_inputs(status, now),
        (experiment.get("kind"), experiment.get("started"), experiment.get("canary")),
        len(tuning.get("verdicts") or []),
        history[-1].get("time"),
        scaling.get("scaledToZeroTime"),
        scaling.get("lastScaleUpTime"),
        bool(scaling.get("scaleDownHeld")),
    )


def rolling_out(status: dict) -> bool:
    """Is the service's rollout under way (its Progressing condition)?"""
    return (find_condition(status, PROGRESSING) or {}).get("status") == "True"


@dataclass
class _Held:
    loop: dict  # the loop keys as the last turn left them
    pending: dict  # the merge patch not written yet
    written_at: float  # monotonic
    writes: deque = field(default_factory=lambda: deque(maxlen=_WRITES_KEPT))  # fingerprints


class StatusMemory:
    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._held: dict[tuple[str, str], _Held] = {}

    def forget(self, key: tuple[str, str]) -> None:
        self._held.pop(key, None)

    def current(self, key: tuple[str, str], status: dict) -> dict:
        """The status a turn starts from: the object's, with this process's own later
        loop keys where the object shows its own writes."""
        held = self._held.get(key)
        if held is None:
            return status
        if fingerprint(status) not in held.writes:
            del self._held[key]  # someone else wrote since: theirs is the state now
            return status
        return {**status, **held.loop}

    def record(self, key: tuple[str, str], before: dict, patch: dict, urgent: bool,
               now: float) -> dict | None:  # fmt: skip
        """Take a turn's patch over ``before`` (what ``current`` gave); the patch to write
        now (everything not written yet), or None to hold it. ``urgent``: the turn posted
        an Event, which must not name a state that status does not show."""
        after = merge_patch(before, patch)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(loop={}, pending={}, written_at=float("-inf"))
            held.writes.append(fingerprint(before))
        held.loop = {k: after[k] for k in LOOP_KEYS if k in after}
        held.pending = compose(held.pending, patch)
        due = self.clock() - held.written_at >= self.interval and not rolling_out(before)
        if not (urgent or due or milestones(before, now) != milestones(after, now)):
            return None
        out, held.pending, held.written_at = held.pending, {}, self.clock()
        held.writes.append(fingerprint(after))
        return out
