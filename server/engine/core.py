"""One turn of the engine: admit what arrived, abort, run the calls, then one step.

The same turn runs on AsyncEngine's engine thread or in the engine process
(engine_process), so both give the same admission, abort, call and step-failure
semantics. A turn holds no event-loop objects (streams, futures): it pickles.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchpilot.server.engine.stats import EngineStats
from batchpilot.server.engine.step_faults import MAX_CONSECUTIVE_STEP_FAILURES, StepFailed

logger = logging.getLogger(__name__)


def kv_event_publisher(engine):
    """The ZMQ publisher of the engine's KV events where --kv-events-config turns them on
    (its block pool then logs them), else None: no cost when off."""
    config = engine.config.kv_events_config
    if config is None or not config.publishes:
        return None
    from batchpilot.server.kv.event_publisher import ZmqEventPublisher  # pyzmq only here
    from batchpilot.server.kv.events import KVEventLog

    publisher = ZmqEventPublisher(config)
    engine.kv_manager.pool.events = KVEventLog(engine.config.block_size)
    return publisher


# (requests as (request_id, prompt, SamplingParams), arrival time, LoRA adapter or None)
Add = tuple[list[tuple[str, Any, Any]], float, str | None]


@dataclass
class Turn:
    outputs: list  # RequestOutput of this step
    stats: EngineStats  # engine.stats() after the step
    stepped: bool  # whether engine.step() ran (histograms of step sizes count only those)
    time: float  # time.monotonic() when the step ended
    admissions: list[BaseException | None] = field(default_factory=list)  # one per add
    aborted: list[str] = field(default_factory=list)
    call_results: list[tuple[Any, BaseException | None]] = field(default_factory=list)
    step_seconds: float = 0.0  # wall time of engine.step(): schedule, forward, sample, outputs


class EngineCore:
    """The engine and the count of steps failed in a row; used by one thread only."""

    def __init__(self, engine):
        self.engine = engine
        self._failed_steps = 0
        self.kv_events = kv_event_publisher(engine)

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def turn(self, adds: list[Add], aborts: list[str], calls: list[Callable[[Any], Any]]) -> Turn:
        engine = self.engine
        admissions = [self._add(*add) for add in adds]
        for rid in aborts:
            engine.abort_request(rid)
        call_results = [self._call(fn) for fn in calls]
        stepped = engine.has_unfinished_requests()
        started = time.monotonic()
        outputs = self._step() if stepped else []
        ended = time.monotonic()
        if self.kv_events is not None:  # the turn's keys, whether its step ran or failed
            self.kv_events.publish(engine.kv_manager.pool.events.take())
        return Turn(outputs, engine.stats(), stepped, ended, admissions, aborts, call_results,
                    step_seconds=ended - started if stepped else 0.0)  # fmt: skip

    def _step(self) -> list:
        """engine.step(); a failed step hands back its batch's error outputs, and only
        MAX_CONSECUTIVE_STEP_FAILURES in a row end the engine (StepFailed escapes)."""
        try:
            outputs = self.engine.step()
        except StepFailed as failed:
            self._failed_steps += 1
            logger.error("an engine step failed (%d in a row; %d end the engine); its "
                         "requests fail, the others go on", self._failed_steps,
                         MAX_CONSECUTIVE_STEP_FAILURES, exc_info=failed.__cause__)  # fmt: skip
            if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            return failed.outputs
        self._failed_steps = 0
        return outputs

    def _add(self, requests, arrival: float, lora_name: str | None) -> BaseException | None:
        added = []
        try:
            for rid, prompt, params in requests:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival,
                                        lora_name=lora_name)  # fmt: skip
                added.append(rid)
        except Exception as e:
            # All or nothing: a half-admitted request would return fewer choices than asked.
            for rid in added:
                self.engine.abort_request(rid)
            return e
        return None

    def _call(self, fn) -> tuple[Any, BaseException | None]:
        try:
            return fn(self.engine), None
        except Exception as e:
            return None, e
