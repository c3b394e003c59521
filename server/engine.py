"""LLMEngine: one step at a time, schedule -> run -> postprocess -> outputs.

The scheduler decides what runs, the model runner computes it and samples, the scheduler
appends the tokens and finishes sequences, and the output processor turns them into
text and RequestOutputs. Not thread-safe: exactly one thread drives it (the server's
engine thread, or LLM.generate offline)."""

import os
import random
from collections.abc import Callable

import torch

from batchpilot.server.config import EngineConfig
from batchpilot.server.device import resolve_device, resolve_dtype
from batchpilot.server.kv.block_pool import BlockPool, SwapSpace
from batchpilot.server.kv.manager import KVCacheManager, cdiv
from batchpilot.server.model.loader import LOAD_STAGES, load_model
from batchpilot.server.model.runner import ModelRunner, ModelRunnerOutput
from batchpilot.server.output_processor import OutputProcessor
from batchpilot.server.outputs import RequestOutput
from batchpilot.server.sampling_params import SamplingParams
from batchpilot.server.scheduler import Scheduler
from batchpilot.server.sequence import Sequence
from batchpilot.server.stats import EngineStats, engine_stats


class RequestRejected(ValueError):
    """A request that can never be served; the server answers 400."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None,
                 on_stage: Callable[[str], None] | None = None, **kwargs):  # fmt: skip
        """on_stage(name) is called as each of LOAD_STAGES begins."""
        self.config = config = config or EngineConfig(**kwargs)
        stage = on_stage or (lambda name: None)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        loaded = load_model(config, resolve_dtype(config.dtype, self.device), self.device, stage)
        self.tokenizer, self.vocab_size = loaded.tokenizer, loaded.vocab_size
        stage(LOAD_STAGES[2])
        self.runner = ModelRunner(config, loaded.decoder, self.device)
        if self.runner.kv_cache.is_fp8:
            self.runner.calibrate_fp8(self.tokenizer)
        kv = self.runner.kv_cache
        pool = BlockPool(kv.num_blocks, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(pool, SwapSpace(kv.num_cpu_blocks), config.block_size)
        self.eos_token_ids = loaded.eos_token_ids
        self.scheduler = Scheduler(config, self.kv_manager, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []  # returned by the next step
        self._rng = random.Random(config.seed)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:  # fmt: skip
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer(prompt)["input_ids"] if text is not None else list(prompt)
        self._check_fits(ids, params)
        params.update_from_eos(self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(self.device).manual_seed(seed)
        seq = Sequence(request_id, text, ids, params, arrival_time, generator)
        self.seqs[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.config.max_model_len
        if not ids:
            raise RequestRejected("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias or ()):
            raise RequestRejected(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if len(ids) > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {len(ids)} input tokens. Please reduce the length of the input messages."
            )
        if len(ids) + params.max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        blocks = cdiv(len(ids) + params.max_tokens, self.config.block_size)
        usable = self.kv_manager.pool.num_blocks - self.kv_manager.watermark_blocks
        if blocks > usable:
            raise RequestRejected(
                f"the request needs {blocks} KV blocks but the cache can give one sequence "
                f"at most {usable}; reduce the prompt or max_tokens"
            )

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._aborted.append(self.output_processor.output(seq, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        decision = self.scheduler.schedule()
        self.runner.swap(decision)
        if not decision.scheduled:
            return outputs
        ran = self.runner.execute(decision.scheduled)
        _record_logprobs(decision.scheduled, ran)
        appended = self.scheduler.postprocess(decision.scheduled, ran.sampled_token_ids)
        for seq in self.output_processor.find_stop_strings(appended):
            self.scheduler.finish(seq, "stop")
        for seq in appended:
            if seq.is_finished:
                del self.seqs[seq.request_id]
            outputs.append(self.output_processor.output(seq, seq.token_ids[-1:]))
        return outputs

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.config)


def _record_logprobs(scheduled: list[tuple[Sequence, int]], ran: ModelRunnerOutput) -> None:
    for (seq, _), prompt_logprobs, logprobs in zip(scheduled, ran.prompt_logprobs, ran.logprobs,
                                                   strict=True):  # fmt: skip
        seq.prompt_logprobs.extend(prompt_logprobs)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
