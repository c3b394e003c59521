"""status.autoscaling through state.py: the shape the loop writes (the CRD keeps it opaque,
so these names are the contract), a lossless round trip, and hand-edited garbage read as
nothing rather than raised."""

from __future__ import annotations

import json

from batchpilot.operator.loop.autoscale import (
    Recommendation,
    ScaleDecision,
    ScaleDownHold,
    ScaleHistory,
)
from batchpilot.operator.loop.idle import IdleState
from batchpilot.operator.loop.state import AutoscalingStatus, LoopState, LoopStatus

HISTORY = ScaleHistory(
    (Recommendation(2, 1000.5), Recommendation(3, 1015.0)),
    (("maxNumSeqs=8,kvCacheDtype=auto,maxNumBatchedTokens=default", 123.5),),
    990.0,
)
HOLD = ScaleDownHold(3, 2, ("http://r1",))
WRITTEN = AutoscalingStatus.decided(
    ScaleDecision(3, "queue", 2, HISTORY), IdleState(1010.0, None, 4567.0), HOLD, 1020.0
)


def test_the_written_shape():
    assert WRITTEN.to_status() == {
        "desiredReplicas": 3,
        "recommendation": 2,
        "reason": "queue",
        "time": "1970-01-01T00:17:00.000Z",
        "recommendations": [
            {"replicas": 2, "time": "1970-01-01T00:16:40.500Z"},
            {"replicas": 3, "time": "1970-01-01T00:16:55.000Z"},
        ],
        "capacityTokensPerSecond": {
            "maxNumSeqs=8,kvCacheDtype=auto,maxNumBatchedTokens=default": 123.5
        },
        "lastScaleUpTime": "1970-01-01T00:16:30.000Z",
        "lastActiveTime": "1970-01-01T00:16:50.000Z",
        "scaledToZeroTime": None,
        "generationTokensSeen": 4567.0,
        "scaleDownHeld": {"replicas": 3, "recommendation": 2, "unscraped": ["http://r1"]},
    }


def test_a_round_trip_through_the_status_is_lossless():
    status = {"autoscaling": json.loads(json.dumps(WRITTEN.to_status()))}
    read = AutoscalingStatus.from_status(status)
    assert read == WRITTEN
    assert LoopStatus.from_status(status).autoscaling == read
    assert LoopState.from_status(status) == LoopState(replicas=3)


def test_no_status_or_garbage_reads_as_nothing_decided():
    assert AutoscalingStatus.from_status(None) == AutoscalingStatus()
    assert AutoscalingStatus.from_status({"autoscaling": "scaled"}) == AutoscalingStatus()
    garbage = {
        "desiredReplicas": "three",
        "recommendations": [{"replicas": 2}, "x", {"replicas": 1, "time": "1970-01-01T00:00:01Z"}],
        "capacityTokensPerSecond": {"a": "fast", "b": 10},
        "lastScaleUpTime": "yesterday",
        "lastActiveTime": 5,
        "generationTokensSeen": "many",
        "scaleDownHeld": {"replicas": 3},
    }
    read = AutoscalingStatus.from_status({"autoscaling": garbage})
    assert read == AutoscalingStatus(
        history=ScaleHistory((Recommendation(1, 1.0),), (("b", 10.0),), None)
    )
