"""The parts of the tuner's memory: the engine settings it tunes, the scores it compares,
the experiment on trial, its verdicts and its decisions, each with its shape inside
``status.tuning`` (``to_status``, and a strict ``from_status`` that raises on anything it
cannot read). ``state.TunerState`` holds them together and is the one reader and writer of
``status.tuning``: it drops, never raises on, an entry someone edited by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from batchpilot import names
from batchpilot.operator.loop.timestamps import parse_timestamp, timestamp

# What a change does. raise/lower: max_num_seqs; raise_budget/lower_budget: the step's
# token budget (max_num_batched_tokens); fp8/fp8_off: the KV-cache dtype; raise_loras: the
# adapters one batch may use (max_loras).
Kind = Literal["raise", "lower", "raise_budget", "lower_budget", "fp8", "fp8_off", "raise_loras"]
# trying: the experiment runs; canary: it runs on one replica; kept / reverted: judged;
# abandoned: cut short (the replicas it ran on went away or stopped answering).
Outcome = Literal["trying", "canary", "kept", "reverted", "abandoned"]

MNS = names.MAX_NUM_SEQS.crd_field
KV = names.KV_CACHE_DTYPE.crd_field
MNBT = names.MAX_NUM_BATCHED_TOKENS.crd_field
MAX_LORAS = names.MAX_LORAS.crd_field


def is_fp8(dtype: str) -> bool:
    return dtype.startswith("fp8")


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings the loop tunes."""

    max_num_seqs: int
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None = None  # None: not tuned (the server's default)
    max_loras: int | None = None  # None: not tuned (spec.engine.maxLoras)

    @property
    def key(self) -> str:
        """A stable name, for verdicts and the capacity figure measured under them (the
        same as before max_loras existed while it is not tuned: verdicts stay valid)."""
        budget = self.max_num_batched_tokens or "default"
        loras = f",maxLoras={self.max_loras}" if self.max_loras is not None else ""
        return f"maxNumSeqs={self.max_num_seqs},kvCacheDtype={self.kv_cache_dtype},maxNumBatchedTokens={budget}{loras}"

    def live_changes(self, other: EngineSettings) -> dict:
        """What /admin/config must be sent to go from ``other`` to these settings."""
        out = {}
        if self.max_num_seqs != other.max_num_seqs:
            out[names.MAX_NUM_SEQS.name] = self.max_num_seqs
        if (
            self.max_num_batched_tokens
            and self.max_num_batched_tokens != other.max_num_batched_tokens
        ):
            out[names.MAX_NUM_BATCHED_TOKENS.name] = self.max_num_batched_tokens
        return out

    def to_status(self) -> dict:
        out: dict = {MNS: self.max_num_seqs, KV: self.kv_cache_dtype}
        if self.max_num_batched_tokens is not None:
            out[MNBT] = self.max_num_batched_tokens
        if self.max_loras is not None:
            out[MAX_LORAS] = self.max_loras
        return out

    @classmethod
    def from_status(cls, d: dict) -> EngineSettings:
        budget, loras = d.get(MNBT), d.get(MAX_LORAS)
        return cls(
            int(d[MNS]),
            str(d[KV]),
            int(budget) if budget is not None else None,
            int(loras) if loras is not None else None,
        )


@dataclass(frozen=True)
class Move:
    """A kind of change from given settings: what a verdict is about. Keyed by where it
    starts, not where it lands: a rejected lower from 30 to 22 also forbids the lower from
    30 to 21 that a slightly different batch would propose next."""

    before: EngineSettings
    kind: Kind

    @property
    def key(self) -> str:
        return f"{self.kind} from {self.before.key}"


MIN_BLOCKS = 4  # turns in a tally before its turn-to-turn spread counts


@dataclass(frozen=True)
class Score:
    """A window reduced to the SLO as clients see it, per replica: the share of requests
    whose mean time per output token and time to first token met their targets (requests
    still waiting past the TTFT target count as misses), and what it rests on."""

    requests: float  # finished requests behind the shares, plus waiting ones past TTFT
    attainment: float  # share of requests within both targets
    throughput: float  # generation tokens/s
    running: float  # mean batch
    waiting: float  # mean queue
    seconds: float
    tpot_p90: float | None = None
    ttft_p99: float | None = None
    variance: float | None = None  # of ``attainment``, from its turns (Tally), when known

    @property
    def load(self) -> float:
        return self.running + self.waiting

    def to_status(self) -> dict:
        out = {
            "requests": round(self.requests, 1),
            "sloAttainment": round(self.attainment, 4),
            "tokensPerSecond": round(self.throughput, 2),
            "running": round(self.running, 2),
            "waiting": round(self.waiting, 2),
            "windowSeconds": round(self.seconds, 1),
        }
        for key, value in (("tpotP90Seconds", self.tpot_p90), ("ttftP99Seconds", self.ttft_p99)):
            if value is not None:
                out[key] = round(value, 4)
        return out

    @classmethod
    def from_status(cls, d: dict) -> Score:
        def maybe(key: str) -> float | None:
            return float(d[key]) if d.get(key) is not None else None

        return cls(
            requests=float(d["requests"]),
            attainment=float(d["sloAttainment"]),
            throughput=float(d["tokensPerSecond"]),
            running=float(d["running"]),
            waiting=float(d["waiting"]),
            seconds=float(d["windowSeconds"]),
            tpot_p90=maybe("tpotP90Seconds"),
            ttft_p99=maybe("ttftP99Seconds"),
        )


@dataclass(frozen=True)
class Tally:
    """Requests counted by a test so far, and how many met the SLO: the test reads each
    turn's new requests and adds them (the observer keeps one minute; a test runs ten).
    Each turn is also kept as a block (its requests r and share a, as sums of r², r²a and
    r²a²), so the test can see how much the share moves from turn to turn: misses come in
    bursts (a queue, a long prompt), and counting requests as independent would make a
    burst look like a verdict."""

    requests: float = 0.0
    within: float = 0.0
    blocks: int = 0
    sq_requests: float = 0.0  # sum of r²
    sq_within: float = 0.0  # sum of r²·a
    sq_within2: float = 0.0  # sum of r²·a²

    def add(self, s: Score | None) -> Tally:
        if s is None or s.requests <= 0:
            return self
        r, a = s.requests, s.attainment
        return Tally(
            self.requests + r, self.within + r * a, self.blocks + 1,
            self.sq_requests + r * r, self.sq_within + r * r * a, self.sq_within2 + r * r * a * a,
        )  # fmt: skip

    def block_variance(self) -> float | None:
        """The batch-means variance of the share (a ratio estimator over the turns); None
        under MIN_BLOCKS turns, too few to say how much it moves."""
        if self.blocks < MIN_BLOCKS or self.requests <= 0:
            return None
        share = self.within / self.requests
        spread = self.sq_within2 - 2 * share * self.sq_within + share * share * self.sq_requests
        n = self.blocks
        return max(spread, 0.0) * n / (n - 1) / (self.requests * self.requests)

    def score(self, seconds: float) -> Score:
        share = self.within / self.requests if self.requests else 1.0
        return Score(self.requests, share, 0.0, 0.0, 0.0, seconds, variance=self.block_variance())

    def to_status(self) -> dict:
        return {
            "requests": round(self.requests, 2),
            "within": round(self.within, 2),
            "blocks": self.blocks,
            "sqRequests": round(self.sq_requests, 2),
            "sqWithin": round(self.sq_within, 2),
            "sqWithin2": round(self.sq_within2, 2),
        }

    @classmethod
    def from_status(cls, d: dict | None) -> Tally:
        if not d:
            return cls()
        return cls(
            float(d["requests"]), float(d["within"]), int(d.get("blocks", 0)),
            float(d.get("sqRequests", 0.0)), float(d.get("sqWithin", 0.0)),
            float(d.get("sqWithin2", 0.0)),
        )  # fmt: skip


@dataclass(frozen=True)
class Experiment:
    """A planned change under its no-harm test (verify.py): ``before`` is what it replaced,
    ``baseline`` the score before it (None with a canary: the other replicas in the same
    window are the control), ``epoch`` the model's when it was planned (a failed test forbids
    the move until the model changes)."""

    kind: Kind
    before: EngineSettings
    after: EngineSettings
    started: float
    reason: str
    baseline: Score | None = None
    canary: str | None = None  # the replica URL trying it; None: every replica
    epoch: int = 0
    trial: Tally = field(default_factory=Tally)  # the replicas running the change
    control: Tally = field(default_factory=Tally)  # the others (with a canary)

    def to_status(self) -> dict:
        out: dict = {
            "kind": self.kind,
            "from": self.before.to_status(),
            "to": self.after.to_status(),
            "started": timestamp(self.started),
            "reason": self.reason,
            "epoch": self.epoch,
            "trial": self.trial.to_status(),
            "control": self.control.to_status(),
        }
        if self.baseline is not None:
            out["baseline"] = self.baseline.to_status()
        if self.canary is not None:
            out["canary"] = self.canary
        return out

    @classmethod
    def from_status(cls, d: dict) -> Experiment:
        return cls(
            kind=d["kind"],
            before=EngineSettings.from_status(d["from"]),
            after=EngineSettings.from_status(d["to"]),
            started=parse_timestamp(d["started"]),
            reason=str(d.get("reason", "")),
            baseline=Score.from_status(d["baseline"]) if d.get("baseline") else None,
            canary=d.get("canary"),
            epoch=int(d.get("epoch", 0)),
            trial=Tally.from_status(d.get("trial")),
            control=Tally.from_status(d.get("control")),
        )


@dataclass(frozen=True)
class Verdict:
    """The last test of moving to ``settings`` (a Move's key): a failed one forbids the move
    while the model is the one that proposed it (the same ``epoch``); a change point or a
    refit starts a new epoch, and the model may propose it again."""

    settings: str
    kept: bool
    time: float
    epoch: int = 0

    def blocks(self, epoch: int) -> bool:
        return not self.kept and epoch == self.epoch

    def to_status(self) -> dict:
        return {
            "settings": self.settings,
            "kept": self.kept,
            "time": timestamp(self.time),
            "epoch": self.epoch,
        }

    @classmethod
    def from_status(cls, d: dict) -> Verdict:
        return cls(
            settings=str(d["settings"]),
            kept=bool(d["kept"]),
            time=parse_timestamp(d["time"]),
            epoch=int(d.get("epoch", 0)),
        )


@dataclass(frozen=True)
class TuneDecision:
    """One turn's decision, and, when it changed something, its history entry."""

    action: Literal["hold", "guard", "try", "canary", "keep", "rollout", "revert", "abandon"]
    settings: EngineSettings  # in force on every replica after this decision
    reason: str
    time: float = 0.0
    kind: Kind | None = None  # the change tried, kept or reverted
    before: Score | None = None
    after: Score | None = None
    inputs: dict = field(default_factory=dict)

    @property
    def changes(self) -> bool:
        return self.action != "hold"

    def to_status(self) -> dict:
        out: dict = {
            "time": timestamp(self.time),
            "action": self.action,
            "kind": self.kind,
            **self.settings.to_status(),
            "reason": self.reason,
        }
        if self.before is not None:
            out["before"] = self.before.to_status()
        if self.after is not None:
            out["after"] = self.after.to_status()
        return out

    @classmethod
    def from_status(cls, d: dict) -> TuneDecision:
        return cls(
            action=d["action"],
            settings=EngineSettings.from_status(d),
            reason=str(d.get("reason", "")),
            time=parse_timestamp(d["time"]),
            kind=d.get("kind"),
            before=Score.from_status(d["before"]) if d.get("before") else None,
            after=Score.from_status(d["after"]) if d.get("after") else None,
        )


@dataclass(frozen=True)
class OverloadRaise:
    """The last guardrail raise past the plan because the replica was overloaded there (the
    arrival rate over what the plan completes within the SLO, or the queue growing at it),
    as long as it binds: the latency guardrail does not lower into it while the overload
    lasts, nor until it has been gone ``TuneLimits.overload_clear_seconds`` (a lower there
    would only trade TPOT misses for TTFT misses, and the queue guardrail would raise again
    a turn later). ``targets``: the (TTFT, TPOT) targets it was judged against; a new SLO is
    a new plan, and the memory is dropped. ``clear_since``: the first turn of the current
    run of turns with no overload and no queue (None: overloaded in the latest turn)."""

    time: float
    before: int  # max_num_seqs it raised from
    after: int  # and to
    plan: int  # the plan's max_num_seqs then
    targets: tuple[float, float]
    clear_since: float | None = None

    def to_status(self) -> dict:
        return {
            "time": timestamp(self.time),
            "from": self.before,
            "to": self.after,
            "plan": self.plan,
            "targets": list(self.targets),
            "clearSince": timestamp(self.clear_since) if self.clear_since is not None else None,
        }

    @classmethod
    def from_status(cls, d: dict) -> OverloadRaise:
        ttft, tpot = d["targets"]
        since = d.get("clearSince")
        return cls(
            time=parse_timestamp(d["time"]),
            before=int(d["from"]),
            after=int(d["to"]),
            plan=int(d["plan"]),
            targets=(float(ttft), float(tpot)),
            clear_since=parse_timestamp(since) if since is not None else None,
        )
