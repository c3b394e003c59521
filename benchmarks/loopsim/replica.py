"""One simulated replica: a queueing model of ``batchpilot serve``'s engine, step by step,
in simulated time (hours of serving in seconds, no model, no torch).

As server/engine/scheduler.py does it: swapped sequences come back first; running sequences
decode (one token each); the step's token budget ``max_num_batched_tokens`` minus those
decodes goes to prefill chunks, first of prompts already admitted, then of waiting
requests admitted FCFS while ``max_num_seqs`` and the KV blocks allow (admission reserves
a prompt's blocks whole). A decoding sequence takes a new KV block each time it crosses a
block boundary; when none is free, the newest running sequence is preempted (swapped to
CPU while swap space lasts, else dropped for recompute). So a larger budget admits long
prompts sooner (TTFT) and makes the steps that carry them longer (ITL).

A step costs O(1) in the number of running sequences: decoding sequences are kept as
sums and counters (their block boundaries by residue, their ends in a heap), which is what
lets a GPU-sized batch of hundreds run for simulated hours.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass

from benchmarks.loopsim.calibration import EngineModel
from benchmarks.loopsim.metrics import (
    ITL_BUCKETS,
    REQUEST_TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    StepCells,
    metrics_text,
)
from benchmarks.loopsim.noise import step_factor
from benchmarks.loopsim.workloads import Request


@dataclass(frozen=True)
class ReplicaConfig:
    max_num_seqs: int = 32
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int = 1 << 30
    swap_space_bytes: int = 4 << 30
    max_num_batched_tokens: int = 2048
    # (TTFT, TPOT) targets the server was given (names.SLO_TTFT/TPOT): counted per request.
    slo: tuple[float, float] | None = None
    # Seconds a client waits for its request to start before it gives up (disconnects,
    # and the server drops the request, as vLLM aborts one); None: clients wait forever.
    client_patience_s: float | None = None


@dataclass(frozen=True)
class StepNoise:
    """A noisy neighbour: with ``probability`` a step takes ``factor`` times as long,
    whatever its batch (another tenant on the same cores or the same GPU)."""

    probability: float
    factor: float


@dataclass(frozen=True)
class Finished:
    """One request, as its client saw it."""

    arrival: float
    first_token: float
    finish: float
    output_len: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (DistServe's TPOT)."""
        gaps = self.output_len - 1
        return (self.finish - self.first_token) / gaps if gaps else 0.0


class _Seq:
    __slots__ = ("blocks", "finish_step", "first_token", "generated", "origin", "req", "todo")

    def __init__(self, req: Request):
        self.req = req
        self.generated = 0  # output tokens so far
        self.todo = 0  # prefill tokens left (while prefilling)
        self.blocks = 0  # KV blocks held while prefilling or swapped
        self.first_token: float | None = None
        self.origin: int | None = None  # while decoding: generated = step - origin
        self.finish_step = -1


class ReplicaSim:
    """One server's engine in simulated time; ``advance_to`` runs whole steps."""

    def __init__(
        self,
        url: str,
        config: ReplicaConfig,
        model: EngineModel,
        start: float,
        noise: StepNoise | None = None,
        seed: int = 0,
    ):
        self.url = url
        self.model = model
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv_cache_dtype = config.kv_cache_dtype
        block_bytes = model.block_bytes(config.kv_cache_dtype)
        self.num_blocks = config.kv_cache_bytes // block_bytes
        self.free_blocks = self.num_blocks
        self.cpu_free = config.swap_space_bytes // block_bytes
        self.time = start
        self.noise = noise
        self._rng = random.Random(seed)
        self.waiting: deque[_Seq] = deque()
        self.swapped: deque[_Seq] = deque()
        self.running: dict[_Seq, None] = {}  # admission order: the newest is preempted first
        self.prefilling: list[_Seq] = []
        self.steps = 0
        # Decoding sequences, in aggregate: how many need a block at a step, by residue of
        # the step number; the sum of (prompt - origin) that gives their context; ends.
        self._by_residue = [0] * model.block_size
        self._context_base = 0
        self._decoding = 0
        self._ends: list[tuple[int, int, _Seq]] = []
        self._ids = itertools.count()
        self.counters = dict.fromkeys(
            ("preemptions", "swaps_out", "swaps_in", "gen", "prompt", "arrivals"), 0
        )
        self.slo = config.slo
        self.patience = config.client_patience_s
        self.abandoned = 0  # requests dropped because their clients gave up
        if self.slo is not None:
            self.counters.update(slo_requests=0, slo_met=0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)  # per finished request with 2+ output tokens
        self.prompt_tokens = Histogram(REQUEST_TOKEN_BUCKETS)
        self.generation_tokens = Histogram(REQUEST_TOKEN_BUCKETS)
        self.step_cells = StepCells()
        self._step_prefill_seqs = 0  # sequences that took a prefill chunk in this step
        self.done: list[Finished] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def finished(self) -> int:
        return len(self.done)

    def metrics_text(self) -> str:
        return metrics_text(self)

    def submit(self, req: Request) -> None:
        self.waiting.append(_Seq(req))
        self.counters["arrivals"] += 1

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    def advance_to(self, t: float) -> None:
        while self.time < t and self.has_work():
            if self.step() is None:
                break  # nothing can run (a prompt larger than the whole KV cache)
        self.time = max(self.time, t)

    # -- one step

    def step(self) -> float | None:
        self._abandon()
        s = self.steps
        seconds = self._swap_in(s) + self._grow(s)
        decodes = self._decoding
        budget = max(self.max_num_batched_tokens, self.max_num_seqs) - decodes
        prefill, prefilled = self._prefill(budget)
        if not decodes and not prefill:
            return None
        seconds += self.model.step_seconds(decodes, self._context_base + decodes * s, prefill)
        if self.noise:
            seconds *= step_factor(self.noise, self.time, self._rng)
        self.time += seconds
        self.steps = s + 1
        self._record_step(s, seconds, decodes, prefill)
        if decodes:
            self.itl.observe(seconds, decodes)
            self.counters["gen"] += decodes
        self._finish_decodes(s)
        for seq in prefilled:
            self._first_token(seq)
        return seconds

    def _abandon(self) -> None:
        """Drop the waiting requests whose clients gave up before their first token. They
        queue in arrival order behind any preempted sequence put back at the front (whose
        client is already streaming, and stays)."""
        if self.patience is None:
            return
        cutoff, waiting = self.time - self.patience, self.waiting
        i = 0
        while i < len(waiting) and waiting[i].first_token is not None:
            i += 1
        while i < len(waiting) and waiting[i].req.arrival < cutoff:
            del waiting[i]
            self.abandoned += 1

    def _record_step(self, s: int, seconds: float, decodes: int, prefill: int) -> None:
        """The step-cost counters, as the server counts them: every running sequence that
        computed in the step, and the decoding ones' tokens in the KV cache (all but the
        last sampled)."""
        context = self._context_base + decodes * s - decodes
        batch = decodes + self._step_prefill_seqs
        self.step_cells.record(batch, seconds, decodes, prefill, context)

    def _grow(self, s: int) -> float:
        """Decoding sequences at a block boundary take a block; preempt the newest running
        sequences until they fit. Returns the seconds spent swapping."""
        residue = -s % self.model.block_size
        seconds = 0.0
        while self._by_residue[residue] > self.free_blocks:
            seconds += self._preempt(next(reversed(self.running)), s)
        self.free_blocks -= self._by_residue[residue]
        return seconds

    def _prefill(self, budget: int) -> tuple[int, list[_Seq]]:
        """Prefill chunks within ``budget``: admitted prompts first, then admissions.
        Returns the tokens prefilled and the sequences whose prompt is now complete."""
        tokens, complete, chunks = 0, [], 0
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = min(seq.todo, budget)
            seq.todo -= n
            budget -= n
            tokens += n
            chunks += 1
        while (
            self.waiting
            and not self.swapped
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            total = seq.req.prompt_len + seq.generated  # a recompute prefills its output too
            need = self._blocks_for(total)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            seq.blocks = need
            n = min(total, budget)
            seq.todo = total - n
            budget -= n
            tokens += n
            chunks += 1
            self.running[seq] = None
            self.prefilling.append(seq)
        self._step_prefill_seqs = chunks
        complete = [seq for seq in self.prefilling if seq.todo == 0]
        if complete:
            self.prefilling = [seq for seq in self.prefilling if seq.todo]
        self.counters["prompt"] += tokens
        return tokens, complete

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.model.block_size)

    # -- decoding sequences, in aggregate

    def _decoding_blocks(self, seq: _Seq, s: int) -> int:
        """Blocks a decoding sequence holds at the start of step ``s``: every token but the
        last sampled one has its KV stored."""
        return self._blocks_for(seq.req.prompt_len + s - seq.origin - 1)

    def _start_decoding(self, seq: _Seq, s: int) -> None:
        """``seq`` has ``generated`` tokens at the start of step ``s`` and decodes on."""
        seq.origin = s - seq.generated
        prompt = seq.req.prompt_len
        self._by_residue[(prompt - seq.origin - 1) % self.model.block_size] += 1
        self._context_base += prompt - seq.origin
        self._decoding += 1
        seq.finish_step = seq.req.output_len + seq.origin - 1
        heapq.heappush(self._ends, (seq.finish_step, next(self._ids), seq))

    def _stop_decoding(self, seq: _Seq, s: int) -> int:
        """Take ``seq`` out of the decoding aggregates at the start of step ``s``; returns
        the blocks it held."""
        blocks = self._decoding_blocks(seq, s)
        prompt = seq.req.prompt_len
        self._by_residue[(prompt - seq.origin - 1) % self.model.block_size] -= 1
        self._context_base -= prompt - seq.origin
        self._decoding -= 1
        seq.generated = s - seq.origin
        seq.origin = None
        del self.running[seq]
        return blocks

    def _finish_decodes(self, s: int) -> None:
        while self._ends and self._ends[0][0] <= s:
            end, _, seq = heapq.heappop(self._ends)
            if seq.origin is None or seq.finish_step != end:
                continue  # preempted since: a stale entry
            self.free_blocks += self._stop_decoding(seq, s + 1)
            self._record(seq)

    def _first_token(self, seq: _Seq) -> None:
        """A prompt (or a recompute) is prefilled: the step sampled its next token."""
        seq.generated += 1
        self.counters["gen"] += 1
        if seq.first_token is None:
            seq.first_token = self.time
            self.ttft.observe(self.time - seq.req.arrival)
        if seq.generated >= seq.req.output_len:
            del self.running[seq]
            self.free_blocks += seq.blocks
            self._record(seq)
            return
        seq.blocks = 0
        self._start_decoding(seq, self.steps)

    def _record(self, seq: _Seq) -> None:
        req = seq.req
        finished = Finished(req.arrival, seq.first_token, self.time, req.output_len)
        self.done.append(finished)
        self.prompt_tokens.observe(req.prompt_len)
        self.generation_tokens.observe(req.output_len)
        if req.output_len >= 2:
            self.tpot.observe(finished.tpot)
        if self.slo is not None:
            self.counters["slo_requests"] += 1
            self.counters["slo_met"] += (
                finished.ttft <= self.slo[0] and finished.tpot <= self.slo[1]
            )

    # -- preemption and swapping

    def _preempt(self, seq: _Seq, s: int) -> float:
        self.counters["preemptions"] += 1
        if seq.origin is None:  # mid-prefill: give the blocks back, prefill again later
            del self.running[seq]
            self.prefilling.remove(seq)
            self.free_blocks += seq.blocks
            seq.blocks = 0
            self.waiting.appendleft(seq)
            return 0.0
        blocks = self._stop_decoding(seq, s)
        self.free_blocks += blocks
        if blocks <= self.cpu_free:
            self.cpu_free -= blocks
            seq.blocks = blocks
            self.counters["swaps_out"] += 1
            self.swapped.append(seq)
            return self._swap_seconds(blocks)
        self.waiting.appendleft(seq)  # recompute: prefill prompt and output again
        return 0.0

    def _swap_seconds(self, blocks: int) -> float:
        return blocks * self.model.block_bytes(self.kv_cache_dtype) / self.model.swap_bytes_per_s

    def _swap_in(self, s: int) -> float:
        seconds = 0.0
        while (
            self.swapped
            and len(self.running) < self.max_num_seqs
            and self.swapped[0].blocks + 1 <= self.free_blocks
        ):
            seq = self.swapped.popleft()
            self.cpu_free += seq.blocks
            self.free_blocks -= seq.blocks
            self.counters["swaps_in"] += 1
            seconds += self._swap_seconds(seq.blocks)
            seq.blocks = 0
            self.running[seq] = None
            self._start_decoding(seq, s)
        return seconds
