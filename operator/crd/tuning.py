"""spec.tuning and spec.slo: the online tuner's bounds and the latency targets it aims at."""

from __future__ import annotations

from pydantic import Field

from batchpilot import names
from batchpilot.operator.crd.base import CamelModel, Rule


class IntRange(CamelModel):
    min: int = Field(8, ge=1, le=4096)
    max: int = Field(256, ge=1, le=4096)

    rules = (
        Rule(
            cel="self.min <= self.max",
            message="tuning.maxNumSeqs.min must be <= tuning.maxNumSeqs.max",
            check=lambda r: r.min <= r.max,
        ),
    )


class TokenRange(CamelModel):
    """Bounds of a step budget, in tokens."""

    min: int = Field(ge=1, le=1 << 20)
    max: int = Field(ge=1, le=1 << 20)

    rules = (
        Rule(
            cel="self.min <= self.max",
            message="tuning.maxNumBatchedTokens.min must be <= tuning.maxNumBatchedTokens.max",
            check=lambda r: r.min <= r.max,
        ),
    )


class LoraRange(CamelModel):
    """Bounds of max_loras, the adapters one batch may use at once."""

    min: int = Field(ge=1, le=64)
    max: int = Field(ge=1, le=64)

    rules = (
        Rule(
            cel="self.min <= self.max",
            message="tuning.maxLoras.min must be <= tuning.maxLoras.max",
            check=lambda r: r.min <= r.max,
        ),
    )


class TuningSpec(CamelModel):
    """The online tuner of max_num_seqs, max_num_batched_tokens and the KV-cache dtype."""

    enabled: bool = False
    max_num_seqs: IntRange = Field(default_factory=IntRange)
    """Bounds the tuner keeps max_num_seqs within."""
    max_num_batched_tokens: TokenRange | None = Field(
        None, alias=names.MAX_NUM_BATCHED_TOKENS.crd_field
    )
    """Bounds the tuner keeps the step budget (max_num_batched_tokens) within; it changes
    live. Pods start with the max (the budget the engine profiles its memory at) and get the
    tuned value once up. Default: not tuned."""
    max_loras: LoraRange | None = Field(None, alias=names.MAX_LORAS.crd_field)
    """Bounds the tuner keeps max_loras within: raised when requests wait for adapters
    that find no free slot while batch slots are free. A change rolls the pods. Default:
    not tuned."""
    allow_fp8_kv_cache: bool = Field(False, alias="allowFP8KVCache")
    """May the tuner switch the KV cache to fp8 and back: to fp8 when memory-bound, back
    when fp8 does not pay (each switch is a rolling restart)."""
    target_inter_token_latency_seconds: float = Field(0.1, gt=0, le=60)
    """The mean time per output token a request should see (its TPOT), at most: the
    tuner plans max_num_seqs within it. spec.slo.interTokenLatencySeconds, when set, takes
    precedence."""
    cooldown_seconds: int = Field(120, ge=0, le=86400)
    """Least time between a change and the next planned one (the loop's dwell is never
    under 10 minutes; guardrails do not wait)."""


class SLOSpec(CamelModel):
    """The service's latency targets. Goodput counts the tokens of the requests that meet
    both."""

    time_to_first_token_seconds: float = Field(2.0, gt=0, le=600)
    """Time to first token a request should see, at most."""
    inter_token_latency_seconds: float | None = Field(None, gt=0, le=60)
    """Mean time per output token a request should see (TPOT: from its first token to its
    last, over its tokens after the first), at most. Default:
    tuning.targetInterTokenLatencySeconds."""
