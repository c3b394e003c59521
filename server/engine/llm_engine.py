"""LLMEngine: one step at a time, schedule -> run -> postprocess -> outputs.

The scheduler decides what runs, the model runner computes it and samples, the scheduler
appends the tokens and finishes sequences, and the output processor turns them into
text and RequestOutputs. Not thread-safe: exactly one thread drives it (the server's
engine thread, or LLM.generate offline)."""

import random
from collections.abc import Callable

import torch

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.admission import check_fits, prompt_parts, request_adapter
from batchpilot.server.engine.parts import build_parts
from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.engine.stats import EngineStats, engine_stats
from batchpilot.server.engine.step_faults import StepFailed
from batchpilot.server.output.outputs import RequestOutput
from batchpilot.server.sampling.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None,
                 on_stage: Callable[[str], None] | None = None, **kwargs):  # fmt: skip
        """on_stage(name) is called as each of LOAD_STAGES begins."""
        self.config = config = config or EngineConfig(**kwargs)
        parts = build_parts(config, on_stage or (lambda name: None))
        self.device, self.tokenizer, self.runner = parts.device, parts.tokenizer, parts.runner
        self.vocab_size, self.eos_token_ids = parts.vocab_size, parts.eos_token_ids
        self.kv_manager, self.scheduler, self.loras = parts.kv_manager, parts.scheduler, parts.loras
        self.output_processor = parts.output_processor
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []  # returned by the next step
        # Unseeded requests get their seed from here: the OS unless --seed fixes the series.
        self._rng = random.SystemRandom() if config.seed is None else random.Random(config.seed)
        # The step budget profiled at start (which sized the KV cache on GPUs): a live
        # budget past it could run out of activation memory.
        self.max_step_tokens = config.max_num_batched_tokens
        # A live max_num_seqs past this would need more blocks than exist, or a step larger
        # than the profiled one.
        self.max_live_num_seqs = min(self.max_step_tokens, self.kv_manager.pool.num_blocks
                                     - self.kv_manager.watermark_blocks)  # fmt: skip

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams, arrival_time: float | None = None,
                    lora_name: str | None = None) -> None:  # fmt: skip
        """prompt: text, token ids, or vLLM's TokensPrompt {"prompt_token_ids": [...]} with
        an optional "prompt" text (kept for echo): how the server hands over prompts it has
        tokenized already, so the engine thread never tokenizes for it. lora_name: a
        registered adapter to run it with (None: the base model); one not loaded waits for
        its read. RequestRejected says why not."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_parts(self.tokenizer, prompt)
        check_fits(ids, params, self.config, self.vocab_size, self.kv_manager)
        lora = request_adapter(self.loras, lora_name)
        params.update_from_eos(self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(self.device).manual_seed(seed)
        seq = Sequence(request_id, text, ids, params, arrival_time, generator, lora, lora_name)
        self.seqs[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    # ---- adapters (between steps, on the engine thread): lora/manager.py -----------------

    def add_lora(self, name: str, path: str) -> None:
        self.loras.add(name, path, self.seqs.values())

    def remove_lora(self, name: str) -> None:
        self.loras.remove(name, self.seqs.values())

    def list_loras(self) -> list[str]:
        return self.loras.names()

    def apply_live_change(self, changes: dict) -> None:
        """Change live knobs (names.LIVE_KNOBS) between steps; ConfigError changes nothing."""
        self.config.apply_live_change(changes, self.max_live_num_seqs, self.max_step_tokens)

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._aborted.append(self.output_processor.output(seq, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run and postprocess one step. A request whose sampling alone raised
        is failed by itself (its output carries `error`). Anything else that raises fails
        the step's whole batch the same way and raises StepFailed, with the engine left
        consistent: the batch's blocks are freed and those the step was filling are
        dropped from the prefix cache, so the engine can go on with other requests."""
        outputs, self._aborted = self._aborted, []
        scheduler = self.scheduler
        unread = self.loras.prepare(scheduler.waiting, [*scheduler.running, *scheduler.swapped])
        outputs += [self._fail(seq, error) for seq, error in unread]
        scheduled: list[tuple[Sequence, int]] = []
        try:
            decision = self.scheduler.schedule()
            scheduled = decision.scheduled
            return outputs + self._run(decision)
        except Exception as error:
            outputs += [self._fail(seq, error) for seq, _ in scheduled]
            raise StepFailed(outputs) from error

    def _run(self, decision) -> list[RequestOutput]:
        """decision: the scheduler's SchedulerOutput for this step."""
        self.runner.swap(decision)
        if not decision.scheduled:
            self.loras.idle()  # nothing could run: an adapter's read may be what it waits for
            return []
        ran = self.runner.execute(decision.scheduled)
        ran.record_logprobs(decision.scheduled)
        appended = self.scheduler.postprocess(decision.scheduled, ran.sampled_token_ids)
        outputs = [self._fail(decision.scheduled[i][0], e) for i, e in ran.faults.items()]
        for seq in self.output_processor.find_stop_strings(appended):
            self.scheduler.finish(seq, "stop")
        for seq in appended:
            if seq.is_finished:
                del self.seqs[seq.request_id]
            outputs.append(self.output_processor.output(seq, seq.token_ids[-1:]))
        return outputs

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End seq because its step raised error; its final output says so."""
        self.kv_manager.forget_uncomputed(seq)
        self.scheduler.finish(seq, "abort")
        self.seqs.pop(seq.request_id, None)
        message = f"the engine failed this request ({type(error).__name__}); see the server log"
        return self.output_processor.failed(seq, message)

    def stats(self) -> EngineStats:
        graphs = self.runner.graphs
        return engine_stats(self.scheduler, self.config, tuple(graphs.sizes) if graphs else ())
