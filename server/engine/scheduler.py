"""One scheduling decision per step.

Order of service: swapped sequences come back first, then running sequences keep
going (decodes before prefill chunks, so a long prompt cannot stall them), then
waiting requests are admitted FCFS while `max_num_seqs`, the token budget
`max_num_batched_tokens` and free blocks allow. A request whose adapter cannot run yet
(one too many for `max_loras` distinct adapters in a step, or not loaded in host memory)
lets later requests whose adapters can run go first, but at most MAX_LORA_OVERTAKES of
them: then it holds the queue until the running adapters drain and its turn comes, so no
adapter starves. Within the same bound, a request whose adapter would be copied into a
device slot lets a later one whose adapter is still in a slot take a free place first.
When blocks run out, the newest running sequence is preempted: swapped to CPU, or freed
for recompute.

After the forward pass, `postprocess` appends the sampled tokens and finishes sequences
on a stop token or on length; stop strings need text, so the output processor finds
them and the engine finishes those sequences through `finish`.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.sequence import Sequence, Status
from batchpilot.server.kv.manager import KVCacheManager

# How many later requests may be admitted ahead of one whose adapter cannot run yet. Each
# such one keeps the batch full with an adapter already in it; past this, the waiting one
# is owed its turn. A few batches' worth: a waiting adapter loses at most that much.
MAX_LORA_OVERTAKES = 64


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, tokens found in cached blocks
    num_steps: int = 0
    prompt_tokens_total: int = 0  # counted when a request makes its first token
    generation_tokens_total: int = 0
    last_step_num_tokens: int = 0
    last_step_batch_size: int = 0
    # Of the last step's batch: the sequences that decoded (one token each, after their
    # first), the prompt (prefill) tokens computed, and the decoding sequences' tokens
    # already in the KV cache (the context their attention reads).
    last_step_decode_seqs: int = 0
    last_step_prefill_tokens: int = 0
    last_step_context_tokens: int = 0
    num_arrivals: int = 0  # requests added


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, eos_token_ids: set[int],
                 in_slot: Callable[[object], bool] | None = None):  # fmt: skip
        """in_slot(adapter): whether a loaded adapter is in a device slot (None: no slots,
        no preference)."""
        self.config = config
        self.in_slot = in_slot
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.counters = SchedulerCounters()

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.counters.num_arrivals += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free seq's blocks and take it out of its queue. An already finished sequence
        only takes the new reason: a stop string in its last token outranks length."""
        if seq.status == Status.SWAPPED:
            self.swapped.remove(seq)
            self.kv.free_swapped(seq)
        elif seq.status in (Status.WAITING, Status.PREEMPTED):
            self.waiting.remove(seq)
            self.kv.free(seq)
        elif seq.status == Status.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.timings.finished_time = time.monotonic()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._swap_in(out)
        budget = self._schedule_running(out, budget, decodes=True)
        budget = self._schedule_running(out, budget, decodes=False)
        # No preemption follows: what is scheduled now is computed in this step, so its
        # blocks are keyed now, for the prompts admitted below to share.
        for seq, n in out.scheduled:
            self.kv.register_computed(seq, n)
        if not self.swapped and self._may_admit():
            self._admit(out, budget)
        self._record_step(out)
        return out

    def _record_step(self, out: SchedulerOutput) -> None:
        counters = self.counters
        counters.num_steps += 1
        counters.last_step_batch_size = len(out.scheduled)
        now = time.monotonic()
        tokens = decodes = prefill = context = 0
        for seq, n in out.scheduled:
            tokens += n
            if seq.timings.first_scheduled_time is None:
                seq.timings.first_scheduled_time = now
            if n == 1 and seq.num_output_tokens and seq.num_uncomputed_tokens == 1:
                decodes += 1  # its next token, after its first
                context += seq.num_computed_tokens
            else:
                prefill += n  # prompt tokens (a recompute's outputs too)
        counters.last_step_num_tokens = tokens
        counters.last_step_decode_seqs = decodes
        counters.last_step_prefill_tokens = prefill
        counters.last_step_context_tokens = context

    def postprocess(self, scheduled: list[tuple[Sequence, int]],
                    tokens: list[int | None]) -> list[Sequence]:  # fmt: skip
        """After the forward pass: advance each sequence's computed tokens (its full blocks
        were keyed when it was scheduled), append its sampled token (None: mid-prefill,
        nothing sampled) and finish it on a stop token or length. -> the sequences that
        got a token."""
        now = time.monotonic()
        appended = []
        for (seq, n), token in zip(scheduled, tokens, strict=True):
            seq.num_computed_tokens += n
            if token is not None:
                self._append(seq, token, now)
                appended.append(seq)
        return appended

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        if seq.timings.first_token_time is None:
            seq.timings.first_token_time = now
            self.counters.prompt_tokens_total += seq.num_prompt_tokens
        seq.timings.last_token_time = now
        seq.token_ids.append(token)
        self.counters.generation_tokens_total += 1
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:
            return None  # min_tokens <= max_tokens, so length cannot be due yet either
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if (
            seq.num_output_tokens >= params.max_tokens
            or seq.num_tokens >= self.config.max_model_len
        ):
            return "length"
        return None

    def _may_admit(self) -> bool:
        if self.config.scheduling_policy == "static":
            return not self.running
        return True

    def _swap_in(self, out: SchedulerOutput) -> None:
        while (
            self.swapped
            and len(self.running) < self.config.max_num_seqs
            and self.kv.can_swap_in(self.swapped[0])
            and self._lora_fits(self.swapped[0])
        ):
            seq = self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.counters.num_swaps_in += 1

    def _schedule_running(self, out: SchedulerOutput, budget: int, decodes: bool) -> int:
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.is_prefill == decodes:
                continue
            if budget <= 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.config.enable_chunked_prefill and n < seq.num_uncomputed_tokens:
                continue
            if not self._reserve(seq, n, out):
                continue
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for n new tokens of seq, preempting the newest others if needed.
        False when seq itself had to be preempted."""
        while not self.kv.allocate_slots(seq, n):
            victim = self.running[-1]
            if victim is seq:
                self._preempt(seq, out)
                return False
            self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq in (s for s, _ in out.scheduled):
            out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            out.swap_out.extend(self.kv.swap_out(seq))
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
            self.counters.num_swaps_out += 1
        else:
            self.kv.reset_for_recompute(seq)
            seq.status = Status.PREEMPTED
            self.waiting.appendleft(seq)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Running seq keeps the step within max_loras distinct adapters."""
        return self._lora_ready(
            seq, {s.lora.cache_root for s in self.running if s.lora is not None}
        )

    def _lora_ready(self, seq: Sequence, running: set[bytes]) -> bool:
        """seq's adapter is loaded and runs with the running ones (their cache roots)
        within max_loras."""
        if seq.lora_name is None:
            return True
        if seq.lora is None:
            return False  # not loaded in host memory yet (lora/manager.py reads it)
        return seq.lora.cache_root in running or len(running) < self.config.max_loras

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        static = self.config.scheduling_policy == "static"
        running = {s.lora.cache_root for s in self.running if s.lora is not None}
        in_slots = self._waiting_in_slots()
        passed: list[Sequence] = []  # ahead of the one considered, their adapters not ready
        for seq in list(self.waiting):
            if len(self.running) >= self.config.max_num_seqs or (budget <= 0 and not static):
                break
            wait = self._lora_waits(seq, running, in_slots)
            # Later requests whose adapters run now go first, which keeps the batch full;
            # one overtaken MAX_LORA_OVERTAKES times is owed its turn: it runs if it can,
            # else holds the queue.
            if wait and seq.lora_overtaken < MAX_LORA_OVERTAKES:
                passed.append(seq)
                continue
            if wait and not self._lora_ready(seq, running):
                break
            n = self._admit_one(seq, out, budget, static)
            if n is None:
                break
            budget -= n
            if seq.lora is not None:
                running.add(seq.lora.cache_root)
            for overtaken in passed:
                overtaken.lora_overtaken += 1

    def _waiting_in_slots(self) -> set[bytes]:
        """The cache roots of waiting requests' adapters that are in device slots."""
        if self.in_slot is None:
            return set()
        loras = {s.lora.cache_root: s.lora for s in self.waiting if s.lora is not None}
        return {root for root, lora in loras.items() if self.in_slot(lora)}

    def _lora_waits(self, seq: Sequence, running: set[bytes], in_slots: set[bytes]) -> bool:
        """seq's adapter cannot run yet, or would take a new place by a copy into a device
        slot while a waiting request's adapter already in a slot could take it: the copy
        is hundreds of small writes, and evicts an adapter later requests may want."""
        if not self._lora_ready(seq, running):
            return True
        lora = seq.lora
        if lora is None or lora.cache_root in running or lora.cache_root in in_slots:
            return False
        return bool(in_slots - running)

    def _admit_one(self, seq: Sequence, out: SchedulerOutput, budget: int,
                   static: bool) -> int | None:  # fmt: skip
        """Admit seq with up to budget prompt tokens; -> the tokens scheduled, or None
        where it does not fit (the queue waits behind it: blocks free up as others end)."""
        # As in vLLM, a request for prompt logprobs computes its whole prompt: a cached
        # block has KV but no logits.
        wants_logits = seq.params.prompt_logprobs is not None
        blocks, hashes = ([], []) if wants_logits else self.kv.match_prefix(seq)
        cached_tokens = len(blocks) * self.kv.block_size
        remaining = seq.num_tokens - cached_tokens
        n = min(remaining, budget)
        if n < remaining and not self.config.enable_chunked_prefill:
            if not static:
                return None
            # Static batching admits its whole batch at once; the prompts are then
            # prefilled over as many steps as the token budget needs.
            n = 0
        if not self.kv.can_admit(seq, blocks):
            return None
        self.waiting.remove(seq)
        self.counters.prefix_cache_queries += seq.num_tokens
        self.counters.prefix_cache_hits += cached_tokens
        if seq.num_preemptions == 0:  # a recomputed sequence keeps its first count
            seq.num_cached_tokens = cached_tokens
        self.kv.admit(seq, blocks, hashes)
        self.kv.allocate_slots(seq, remaining)
        seq.status = Status.RUNNING
        self.running.append(seq)
        if n > 0:
            out.scheduled.append((seq, n))
            self.kv.register_computed(seq, n)
        return n
