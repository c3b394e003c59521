"""The loop's state as read back from an InferenceService's status."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.operator.loop.tuner_state import settings_from_status


@dataclass(frozen=True)
class LoopState:
    """What the autoscaler and the tuner have decided, read back from status (None: nothing
    yet). The builders persist it in the Deployment so that new pods start with it."""

    replicas: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None
    max_num_batched_tokens: int | None = None
    max_loras: int | None = None

    @classmethod
    def from_status(cls, status: dict | None) -> LoopState:
        autoscaling = (status or {}).get("autoscaling") or {}
        tuned = settings_from_status(status)  # the tuner's state has one reader
        return cls(
            replicas=autoscaling.get("desiredReplicas"),
            max_num_seqs=tuned.max_num_seqs if tuned else None,
            kv_cache_dtype=tuned.kv_cache_dtype if tuned else None,
            max_num_batched_tokens=tuned.max_num_batched_tokens if tuned else None,
            max_loras=tuned.max_loras if tuned else None,
        )
