"""LLMEngine: owns the model, the KV cache and the scheduler, and runs one step at a
time. Not thread-safe: exactly one thread drives it (the server's engine thread, or
LLM.generate offline)."""

import logging
import os
import random
import time
from collections.abc import Callable

import torch

from batchpilot.server.config import ConfigError, EngineConfig, GiB
from batchpilot.server.detokenizer import IncrementalDetokenizer
from batchpilot.server.kv.block_pool import BlockPool, SwapSpace
from batchpilot.server.kv.cache import KVCache, bytes_per_block, storage_dtype
from batchpilot.server.kv.manager import KVCacheManager, cdiv
from batchpilot.server.model.llama import from_hf
from batchpilot.server.model.loader import load_hf_model
from batchpilot.server.model.runner import ModelRunner
from batchpilot.server.outputs import CompletionOutput, RequestOutput
from batchpilot.server.sampling_params import SamplingParams
from batchpilot.server.scheduler import Scheduler
from batchpilot.server.sequence import Sequence
from batchpilot.server.stop import StopChecker

log = logging.getLogger("batchpilot.engine")

CALIBRATION_TEXT = (
    "Continuous batching admits new requests at every decode step. 连续批处理在每个解码步"
    "调度请求。 def f(x):\n    return [i * 2 for i in range(x)]\n"
)


class RequestRejected(ValueError):
    """A request that can never be served; the server answers 400."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        fast_bf16 = "avx512_bf16" in _cpu_flags() or "amx_bf16" in _cpu_flags()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, name)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _check_sliding_window(hf_config, max_model_len: int) -> None:
    """Sliding-window attention is not implemented; within the window it is plain
    causal attention, so such models run exactly up to the window."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) and window and max_model_len > window:
        raise ConfigError(
            f"this model uses sliding-window attention (window {window}), which batchpilot "
            f"does not implement: set max_model_len <= {window}"
        )


LOAD_STAGES = ("loading weights", "building the decoder", "allocating the KV cache")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None,
                 on_stage: Callable[[str], None] | None = None, **kwargs):  # fmt: skip
        """on_stage(name) is called as each of LOAD_STAGES begins."""
        self.config = config = config or EngineConfig(**kwargs)
        stage = on_stage or (lambda name: None)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        stage(LOAD_STAGES[0])
        hf_model, self.tokenizer = load_hf_model(config.model, self.dtype)
        config.resolve(hf_model.config.max_position_embeddings)
        _check_sliding_window(hf_model.config, config.max_model_len)
        stage(LOAD_STAGES[1])
        self.model = from_hf(hf_model, config.max_model_len, self.dtype, self.device)
        self.eos_token_ids = self._eos_ids(hf_model)
        self.vocab_size = hf_model.config.vocab_size
        del hf_model
        self.seqs: dict[str, Sequence] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self._reset_counters()
        stage(LOAD_STAGES[2])
        self._build_kv_cache()

    def _reset_counters(self) -> None:
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step_num_tokens = 0
        self.last_step_batch_size = 0

    def _eos_ids(self, hf_model) -> set[int]:
        ids = set()
        for source in (hf_model.generation_config, hf_model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        return ids

    def _build_kv_cache(self) -> None:
        cfg = self.config
        layers, heads, dim = len(self.model.layers), self.model.num_kv_heads, self.model.head_dim
        kv_dtype = storage_dtype(cfg.kv_cache_dtype, self.dtype)
        block_bytes = bytes_per_block(layers, cfg.block_size, heads, dim, kv_dtype)
        num_blocks = self._kv_budget_bytes(block_bytes) // block_bytes
        needed = cdiv(cfg.max_model_len, cfg.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks but one max_model_len "
                f"({cfg.max_model_len}) sequence needs {needed}: raise kv_cache_memory "
                "or gpu_memory_utilization, or lower max_model_len"
            )
        num_cpu_blocks = cfg.swap_space_bytes // block_bytes
        self.block_bytes = block_bytes
        self.kv_cache = KVCache(
            layers,
            num_blocks,
            num_cpu_blocks,
            cfg.block_size,
            heads,
            dim,
            self.dtype,
            cfg.kv_cache_dtype,
            self.device,
        )
        pool = BlockPool(num_blocks, cfg.enable_prefix_caching)
        self.kv_manager = KVCacheManager(pool, SwapSpace(num_cpu_blocks), cfg.block_size)
        self.scheduler = Scheduler(cfg, self.kv_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg.block_size, self.device)
        if self.kv_cache.is_fp8:
            self._calibrate_fp8()
        log.info(
            "KV cache: %d blocks of %d tokens (%s, %.1f MiB), max concurrency %.2fx at "
            "max_model_len %d; swap space %d blocks",
            num_blocks,
            cfg.block_size,
            cfg.kv_cache_dtype,
            num_blocks * block_bytes / 2**20,
            self.max_concurrency,
            cfg.max_model_len,
            num_cpu_blocks,
        )

    def _kv_budget_bytes(self, block_bytes: int) -> int:
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return cfg.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return 1 * GiB
        peak = self._profile_peak_bytes(block_bytes)
        total = torch.cuda.mem_get_info(self.device)[1]
        return max(0, int(total * cfg.gpu_memory_utilization) - peak)

    def _profile_peak_bytes(self, block_bytes: int) -> int:
        """Weights plus the activation peak of a full-budget prefill, measured by running it."""
        cfg = self.config
        n = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        blocks = cdiv(n, cfg.block_size)
        scratch = KVCache(
            len(self.model.layers),
            blocks,
            0,
            cfg.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype,
            cfg.kv_cache_dtype,
            self.device,
        )
        seq = Sequence("profile", None, [0] * n, SamplingParams(max_tokens=1, temperature=0))
        seq.block_table = list(range(blocks))
        seq.generator = torch.Generator(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ModelRunner(self.model, scratch, cfg.block_size, self.device).execute([(seq, n)])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - blocks * block_bytes
        del scratch
        torch.cuda.empty_cache()
        return peak

    def _calibrate_fp8(self) -> None:
        ids = self.tokenizer(CALIBRATION_TEXT)["input_ids"][: self.config.max_model_len - 1]
        self.kv_cache.calibrating = True
        self.add_request("__fp8_calibration__", ids, SamplingParams(max_tokens=1, temperature=0))
        while self.has_unfinished_requests():
            self.step()
        self.kv_cache.finish_calibration()
        self.kv_manager.pool.reset_prefix_cache()
        self.scheduler.counters = type(self.scheduler.counters)()
        self._reset_counters()
        self._pending_outputs.clear()

    @property
    def max_concurrency(self) -> float:
        cfg = self.config
        return self.kv_manager.pool.num_blocks / cdiv(cfg.max_model_len, cfg.block_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer(prompt)["input_ids"] if text is not None else list(prompt)
        self._check_fits(ids, params)
        seq = Sequence(request_id, text, ids, params, arrival_time)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq.generator = torch.Generator(self.device).manual_seed(seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        seq.stop_checker = StopChecker(params.stop_strings)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.config.max_model_len
        if not ids:
            raise RequestRejected("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
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
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        seq.timings.finished_time = time.monotonic()
        self._pending_outputs.append(self._output(seq, [], finished=True))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def set_max_num_seqs(self, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {value!r}")
        self.config.max_num_seqs = value
        self.config.max_num_batched_tokens = max(self.config.max_num_batched_tokens, value)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        decision = self.scheduler.schedule()
        self.kv_cache.swap_out(decision.swap_out)
        self.kv_cache.swap_in(decision.swap_in)
        self.num_steps += 1
        self.last_step_num_tokens = decision.num_tokens
        self.last_step_batch_size = len(decision.scheduled)
        if not decision.scheduled:
            return outputs
        now = time.monotonic()
        for seq, _ in decision.scheduled:
            if seq.timings.first_scheduled_time is None:
                seq.timings.first_scheduled_time = now
        sampled = self.runner.execute(decision.scheduled)
        for seq, n in decision.scheduled:
            seq.num_computed_tokens += n
            self.kv_manager.register_computed(seq)
            token = sampled.get(id(seq))
            if token is not None:
                outputs.append(self._append_token(seq, token))
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        now = time.monotonic()
        if seq.timings.first_token_time is None:
            seq.timings.first_token_time = now
            self.prompt_tokens_total += seq.num_prompt_tokens
        seq.timings.last_token_time = now
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        params = seq.params
        reason = None
        if (
            token in self.eos_token_ids and not params.ignore_eos
        ) or token in params.stop_token_ids:
            reason = "stop"
        else:
            seq.text += seq.detokenizer.add(token)
            if seq.stop_checker.truncate(seq):
                reason = "stop"
            elif (
                seq.num_output_tokens >= params.max_tokens
                or seq.num_tokens >= self.config.max_model_len
            ):
                reason = "length"
        if reason is not None:
            seq.timings.finished_time = now
            self.scheduler.finish(seq, reason)
            del self.seqs[seq.request_id]
        return self._output(seq, [token], finished=reason is not None)

    def _output(self, seq: Sequence, new_tokens: list[int], finished: bool) -> RequestOutput:
        visible = seq.text if finished else seq.stop_checker.releasable(seq.text)
        delta_text = visible[seq.emitted_text_len :]
        seq.emitted_text_len = len(visible)
        completion = CompletionOutput(
            0,
            visible,
            seq.output_token_ids,
            delta_text,
            new_tokens,
            seq.finish_reason if finished else None,
        )
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished, seq.timings
        )

    def stats(self) -> dict:
        pool, swap = self.kv_manager.pool, self.kv_manager.swap
        counters = self.scheduler.counters
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_kv_blocks": pool.num_blocks,
            "num_free_kv_blocks": pool.num_free,
            "kv_cache_usage": 1.0 - pool.num_free / pool.num_blocks,
            "num_cpu_blocks": swap.num_blocks,
            "num_free_cpu_blocks": swap.num_free,
            "cpu_cache_usage": 1.0 - swap.num_free / swap.num_blocks if swap.num_blocks else 0.0,
            "num_preemptions": counters.num_preemptions,
            "num_swaps_out": counters.num_swaps_out,
            "num_swaps_in": counters.num_swaps_in,
            "prefix_cache_queries": counters.prefix_cache_queries,
            "prefix_cache_hits": counters.prefix_cache_hits,
            "num_steps": self.num_steps,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "last_step_num_tokens": self.last_step_num_tokens,
            "last_step_batch_size": self.last_step_batch_size,
            "max_num_seqs": self.config.max_num_seqs,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "block_size": self.config.block_size,
            "max_concurrency": self.max_concurrency,
        }
