"""LLMEngine: one step at a time, schedule -> run -> postprocess -> outputs.

The scheduler decides what runs, the model runner computes it and samples, the scheduler
appends the tokens and finishes sequences, and the output processor turns them into
text and RequestOutputs. Not thread-safe: exactly one thread drives it (the server's
engine thread, or LLM.generate offline)."""

import random
from collections.abc import Callable

import torch

from batchpilot.server.config import EngineConfig
from batchpilot.server.cpu_budget import cpu_threads
from batchpilot.server.cpu_malloc import keep_freed_memory
from batchpilot.server.device import resolve_device, resolve_dtype
from batchpilot.server.faults import StepFailed
from batchpilot.server.kv.block_pool import BlockPool, SwapSpace
from batchpilot.server.kv.manager import KVCacheManager, cdiv
from batchpilot.server.lora import LoRAError, LoRAInUse
from batchpilot.server.lora.registry import LoRARegistry
from batchpilot.server.lora.slots import module_shapes
from batchpilot.server.model.loader import LOAD_STAGES, load_model
from batchpilot.server.model.runner import ModelRunner, ModelRunnerOutput
from batchpilot.server.output_processor import OutputProcessor
from batchpilot.server.outputs import CompletionOutput, RequestOutput
from batchpilot.server.sampling_params import SamplingParams
from batchpilot.server.scheduler import Scheduler, SchedulerOutput
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
            torch.set_num_threads(cpu_threads(config.cpu_threads))
            keep_freed_memory()
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
        self.loras = None
        if config.enable_lora:
            self.loras = LoRARegistry(module_shapes(loaded.decoder), len(loaded.decoder.layers),
                                      config.max_lora_rank,
                                      config.lora_capacity)  # fmt: skip
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []  # returned by the next step
        # Unseeded requests get their seed from here: the OS unless --seed fixes the series.
        self._rng = random.SystemRandom() if config.seed is None else random.Random(config.seed)
        # The step budget profiled at start (which sized the KV cache on GPUs): a live
        # budget past it could run out of activation memory.
        self.max_step_tokens = config.max_num_batched_tokens
        # A live max_num_seqs past this would need more blocks than exist, or a step larger
        # than the profiled one.
        self.max_live_num_seqs = min(self.max_step_tokens,
                                     pool.num_blocks - self.kv_manager.watermark_blocks)  # fmt: skip

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams, arrival_time: float | None = None,
                    lora_name: str | None = None) -> None:  # fmt: skip
        """prompt: text, token ids, or vLLM's TokensPrompt {"prompt_token_ids": [...]} with
        an optional "prompt" text (kept for echo): how the server hands over prompts it has
        tokenized already, so the engine thread never tokenizes for it. lora_name: a loaded
        adapter to run it with (None: the base model)."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_parts(prompt)
        self._check_fits(ids, params)
        lora = self._adapter(lora_name)
        params.update_from_eos(self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(self.device).manual_seed(seed)
        seq = Sequence(request_id, text, ids, params, arrival_time, generator, lora)
        self.seqs[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def _adapter(self, name: str | None):
        if name is None:
            return None
        if self.loras is None:
            raise RequestRejected(f"adapter {name!r} asked for but LoRA is not enabled")
        try:
            return self.loras.get(name)
        except LoRAError as e:
            raise RequestRejected(str(e)) from e

    # ---- adapters (between steps, on the engine thread) ---------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Load and check a PEFT adapter; LoRAError says why it cannot serve."""
        if self.loras is None:
            raise LoRAError("LoRA is not enabled: start the server with --enable-lora")
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; LoRAInUse while requests for it are waiting or running."""
        if self.loras is None:
            raise LoRAError("LoRA is not enabled: start the server with --enable-lora")
        adapter = self.loras.get(name)
        in_flight = sum(1 for seq in self.seqs.values() if seq.lora is adapter)
        if in_flight:
            raise LoRAInUse(f"The lora adapter '{name}' has {in_flight} requests in flight; "
                            "unload it once they finish")  # fmt: skip
        self.loras.remove(name)
        self.runner.lora_slots.forget(adapter)

    def list_loras(self) -> list[str]:
        return list(self.loras.adapters) if self.loras else []

    def lora_paths(self) -> dict[str, str]:
        return {name: a.path for name, a in self.loras.adapters.items()} if self.loras else {}

    def _prompt_parts(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        return None, list(prompt)

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.config.max_model_len
        if not ids:
            raise RequestRejected("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias or ()):
            raise RequestRejected(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be in [0, {self.vocab_size})")
        if params.top_k > self.vocab_size:
            raise RequestRejected(f"top_k must be at most the vocabulary size "
                                  f"{self.vocab_size} (or -1 for all), got {params.top_k}")  # fmt: skip
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
        scheduled: list[tuple[Sequence, int]] = []
        try:
            decision = self.scheduler.schedule()
            scheduled = decision.scheduled
            return outputs + self._run(decision)
        except Exception as error:
            outputs += [self._fail(seq, error) for seq, _ in scheduled]
            raise StepFailed(outputs) from error

    def _run(self, decision: SchedulerOutput) -> list[RequestOutput]:
        self.runner.swap(decision)
        if not decision.scheduled:
            return []
        ran = self.runner.execute(decision.scheduled)
        _record_logprobs(decision.scheduled, ran)
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
        self.output_processor.discard(seq.request_id)
        message = f"the engine failed this request ({type(error).__name__}); see the server log"
        completion = CompletionOutput(0, "", seq.output_token_ids, "", [], "abort")
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             True, seq.timings, seq.num_cached_tokens, error=message)  # fmt: skip

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.config)


def _record_logprobs(scheduled: list[tuple[Sequence, int]], ran: ModelRunnerOutput) -> None:
    for (seq, _), prompt_logprobs, logprobs in zip(scheduled, ran.prompt_logprobs, ran.logprobs,
                                                   strict=True):  # fmt: skip
        seq.prompt_logprobs.extend(prompt_logprobs)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
