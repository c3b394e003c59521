"""The model runner: sizes and allocates the KV cache, calibrates FP8 scales, and turns
one scheduler decision into one forward pass. The step's tokens are flattened (decodes
first, then prefill chunks) with per-token positions and slots, and logits are computed
only where a sequence will sample or scores a prompt token."""

import logging
from dataclasses import dataclass, field

import torch

from batchpilot.server.attention import (
    build_attention_metadata,
    cpu_decode_choice,
    num_sms,
    resolve_backend,
)
from batchpilot.server.attention.triton_metadata import TritonMetadata
from batchpilot.server.config import EngineConfig, GiB
from batchpilot.server.engine.scheduler import SchedulerOutput
from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.kv.cache import KVCache, bytes_per_block, storage_dtype
from batchpilot.server.kv.manager import cdiv
from batchpilot.server.lora.slots import LoRABatch, LoRASlots, module_shapes
from batchpilot.server.model import cpu_gemv, cpu_layer, cpu_linear, cpu_norm
from batchpilot.server.model.cuda_graphs import DecodeGraphs
from batchpilot.server.model.llama import LlamaDecoder
from batchpilot.server.sampling.logprobs import PositionLogprobs, compute_logprobs, gather_logprobs
from batchpilot.server.sampling.sampler import sample_isolating_faults
from batchpilot.server.sampling.sampling_params import SamplingParams

log = logging.getLogger("batchpilot.engine")

# FP8 scales come from the K/V amax of one prefill over varied text: prose, CJK and code.
CALIBRATION_TEXT = (
    "Continuous batching admits new requests at every decode step. 连续批处理在每个解码步"
    "调度请求。 def f(x):\n    return [i * 2 for i in range(x)]\n"
)


@dataclass
class ModelRunnerOutput:
    """One entry per scheduled sequence, in the scheduler's order."""

    sampled_token_ids: list[int | None]  # None: mid-prefill, nothing sampled
    logprobs: list[PositionLogprobs | None]  # the sampled token's, when asked for
    prompt_logprobs: list[list[PositionLogprobs]]  # for the prompt tokens this step scored
    faults: dict[int, Exception] = field(default_factory=dict)  # index -> its sampling's error

    @classmethod
    def empty(cls, n: int) -> "ModelRunnerOutput":
        return cls([None] * n, [None] * n, [[] for _ in range(n)])

    def record_logprobs(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Append this step's logprobs to the sequences they were computed for."""
        for (seq, _), prompt_logprobs, logprobs in zip(scheduled, self.prompt_logprobs,
                                                       self.logprobs, strict=True):  # fmt: skip
            seq.prompt_logprobs.extend(prompt_logprobs)
            if logprobs is not None:
                seq.logprobs.append(logprobs)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaDecoder, device: torch.device):
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.block_size
        self.attention_backend = resolve_backend(
            config.attention_backend, device, config.kv_cache_dtype
        )
        if self.attention_backend != "triton" and device.type == "cpu":  # built, then timed
            self.attention_backend = cpu_decode_choice.choose(  # now, not at the first decode step
                config.attention_backend, model.layers[0].num_heads, model.num_kv_heads,
                model.head_dim, model.lm_head.weight.dtype, config.block_size,
                config.kv_cache_dtype,
            )  # fmt: skip
        self.linear_backend = "torch"
        if device.type == "cpu":
            self.linear_backend = (cpu_gemv.apply(model, config.linear_backend)
                                   or cpu_linear.apply(model, config.linear_backend))  # fmt: skip
            cpu_norm.load()  # loaded now, before Ready, not in the first request's step
        # Small decode steps' layers as one C++ call (bf16 on the GEMV kernel only).
        self.fused = cpu_layer.FusedDecode.of(model) if self.linear_backend == "gemv" else None
        self.graphs: DecodeGraphs | None = None  # captured at the first decode-only step
        kv_dtype = storage_dtype(config.kv_cache_dtype, model.lm_head.weight.dtype)
        self.block_bytes = bytes_per_block(len(model.layers), config.block_size,
                                           model.num_kv_heads, model.head_dim, kv_dtype)  # fmt: skip
        # The adapter slots exist before the KV cache is sized, so that on GPUs the
        # profiled peak counts their memory.
        self.lora_slots = None
        if config.enable_lora:
            self.lora_slots = LoRASlots(len(model.layers), module_shapes(model), config.max_loras,
                                        config.max_lora_rank, model.lm_head.weight.dtype, device,
                                        use_triton=device.type == "cuda")  # fmt: skip
        # None while the profiling prefill runs (into a scratch cache), so that _forward's
        # "is this the engine's cache?" test reads False instead of raising.
        self.kv_cache: KVCache | None = None
        self.kv_cache = self._allocate_kv_cache()

    # ---- KV cache --------------------------------------------------------------------

    def _new_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> KVCache:
        m = self.model
        return KVCache(len(m.layers), num_blocks, num_cpu_blocks, self.block_size, m.num_kv_heads,
                       m.head_dim, m.lm_head.weight.dtype, self.config.kv_cache_dtype,
                       self.device)  # fmt: skip

    def _allocate_kv_cache(self) -> KVCache:
        cfg = self.config
        num_blocks = self._kv_budget_bytes() // self.block_bytes
        needed = cdiv(cfg.max_model_len, cfg.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks but one max_model_len "
                f"({cfg.max_model_len}) sequence needs {needed}: raise kv_cache_memory "
                "or gpu_memory_utilization, or lower max_model_len"
            )
        num_cpu_blocks = cfg.swap_space_bytes // self.block_bytes
        log.info(
            "KV cache: %d blocks of %d tokens (%s, %.1f MiB), max concurrency %.2fx at "
            "max_model_len %d; swap space %d blocks", num_blocks, cfg.block_size,
            cfg.kv_cache_dtype, num_blocks * self.block_bytes / 2**20,
            num_blocks / cdiv(cfg.max_model_len, cfg.block_size), cfg.max_model_len,
            num_cpu_blocks,
        )  # fmt: skip
        return self._new_kv_cache(num_blocks, num_cpu_blocks)

    def _kv_budget_bytes(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return cfg.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return 1 * GiB
        peak = self._profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        return kv_budget_bytes(total, cfg.gpu_memory_utilization, peak, outside_torch)

    def _profile_peak_bytes(self) -> int:
        """Weights plus the activation peak of a full-budget prefill, measured by running it."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        blocks = cdiv(n, self.block_size)
        scratch = self._new_kv_cache(blocks, 0)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._prefill([0] * n, scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - blocks * self.block_bytes
        del scratch
        torch.cuda.empty_cache()
        return peak

    def calibrate_fp8(self, tokenizer) -> None:
        """Per-layer, per-head FP8 scales from the K/V of one calibration prefill. Its
        blocks stay free: the scheduler never saw them, so nothing reads them later."""
        ids = tokenizer(CALIBRATION_TEXT)["input_ids"][: self.config.max_model_len - 1]
        self.kv_cache.calibrating = True
        self._prefill(ids, self.kv_cache)
        self.kv_cache.finish_calibration()

    def _prefill(self, token_ids: list[int], kv: KVCache) -> None:
        """One whole-prompt forward into blocks 0.. of kv, outside the scheduler."""
        seq = Sequence("warmup", None, token_ids, SamplingParams(max_tokens=1, temperature=0))
        seq.block_table = list(range(cdiv(len(token_ids), self.block_size)))
        self.execute([(seq, len(token_ids))], kv)

    def swap(self, decision: SchedulerOutput) -> None:
        self.kv_cache.swap_out(decision.swap_out)
        self.kv_cache.swap_in(decision.swap_in)

    # ---- one step ----------------------------------------------------------------------

    def _forward(self, input_ids, positions, kv: KVCache, meta, logits_index,
                 lora: LoRABatch | None) -> torch.Tensor:  # fmt: skip
        """The model's forward, replayed from a CUDA graph for a decode-only step when
        cuda_graphs is on (graphs are captured here, at the first such step, after fp8
        calibration; steps outside the profile and calibration runs use self.kv_cache).
        Steps with adapter rows are never replayed: the graphs hold the base model only."""
        if self.fused is not None and self.fused.fits(meta, kv, lora, len(input_ids)):
            return self.fused(input_ids, positions, kv, meta, logits_index)
        decode_only = (isinstance(meta, TritonMetadata) and kv is self.kv_cache
                       and meta.num_decodes == len(input_ids) == len(logits_index))  # fmt: skip
        wanted = self.config.cuda_graphs and self.device.type == "cuda" and lora is None
        if not (wanted and decode_only and not kv.calibrating):
            return self.model(input_ids, positions, kv, meta, logits_index, lora)
        if self.graphs is None:
            log.info("capturing CUDA graphs for decode steps of up to %d sequences",
                     self.config.max_num_seqs)  # fmt: skip
            self.graphs = DecodeGraphs(self.model, kv, self.config.max_num_seqs,
                                       self.config.max_model_len, num_sms(self.device),
                                       self.device)  # fmt: skip
        if not self.graphs.fits(len(input_ids)):  # max_num_seqs raised live past the capture
            return self.model(input_ids, positions, kv, meta, logits_index)
        return self.graphs.replay(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]],
                kv: KVCache | None = None) -> ModelRunnerOutput:  # fmt: skip
        """One forward pass over the scheduled chunks. Logits are computed where a
        sequence samples (all of its uncomputed tokens are computed this step) and where a
        prompt token's logprob was asked for; both come from this one forward."""
        # Decodes first, shortest context first, so attention can bucket them by length.
        order = sorted(range(len(scheduled)), key=lambda i: _decode_first(*scheduled[i]))
        ordered = [scheduled[i] for i in order]
        input_ids, positions, logits_index, samplers, row_adapters = [], [], [], [], []
        scoring: list[tuple[int, range, int]] = []  # (scheduled index, positions, first row)
        for i, (seq, n) in zip(order, ordered, strict=True):
            start = seq.num_computed_tokens
            scored = _prompt_positions(seq, start, n)
            if scored:
                scoring.append((i, scored, len(input_ids) + scored.start - start))
            input_ids.extend(seq.token_ids[start : start + n])
            if self.lora_slots:
                row_adapters.extend([seq.lora] * n)
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                logits_index.append(len(input_ids) - 1)
                samplers.append(i)
        num_decodes = sum(1 for seq, n in ordered if n == 1 and not seq.is_prefill)
        meta = build_attention_metadata(
            self.attention_backend,
            [(seq.block_table, seq.num_computed_tokens, n) for seq, n in ordered],
            num_decodes,
            self.block_size,
            self.model.lm_head.weight.dtype,
            self.model.num_kv_heads,
            self.device,
        )
        prompt_rows = [row + k for _, scored, row in scoring for k in range(len(scored))]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        lora = self.lora_slots.batch(row_adapters) if self.lora_slots else None

        def forward() -> torch.Tensor:  # again only if sampling raises: K/V writes repeat
            return self._forward(as_tensor(input_ids), as_tensor(positions),
                                 kv or self.kv_cache, meta, as_tensor(logits_index + prompt_rows),
                                 lora)  # fmt: skip

        logits = forward()
        out = ModelRunnerOutput.empty(len(scheduled))
        sampled = sample_isolating_faults(logits[: len(samplers)],
                                          [scheduled[i][0] for i in samplers],
                                          self.config.logprobs_mode,
                                          lambda: forward()[: len(samplers)])  # fmt: skip
        for i, token, logprobs in zip(samplers, sampled.token_ids, sampled.logprobs, strict=True):
            out.sampled_token_ids[i], out.logprobs[i] = token, logprobs
        out.faults = {samplers[row]: error for row, error in sampled.faults.items()}
        if scoring:
            self._score_prompts(logits[len(samplers) :], scheduled, scoring, out)
        return out

    def _score_prompts(self, logits: torch.Tensor, scheduled, scoring, out) -> None:
        """Prompt logprobs: the logits at position p score prompt token p + 1."""
        targets, nums = [], []
        for i, scored, _ in scoring:
            seq = scheduled[i][0]
            targets.extend(seq.token_ids[p + 1] for p in scored)
            nums.extend([seq.params.prompt_logprobs] * len(scored))
        target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
        positions = iter(gather_logprobs(compute_logprobs(logits), target_ids, nums))
        for i, scored, _ in scoring:
            out.prompt_logprobs[i] = [next(positions) for _ in scored]


def _prompt_positions(seq: Sequence, start: int, n: int) -> range:
    """The positions of this chunk whose logits score a prompt token still unscored: the
    last prompt position predicts the first output token instead, and a chunk computed
    again after a recompute preemption has its prompt tokens scored already."""
    if seq.params.prompt_logprobs is None:
        return range(0)
    first = max(start, len(seq.prompt_logprobs) - 1)
    return range(first, max(first, min(start + n, seq.num_prompt_tokens - 1)))


def kv_budget_bytes(total: int, utilization: float, peak: int, outside_torch: int) -> int:
    """Bytes of device memory for KV blocks: the utilization share of the device, less
    the warm-up's peak torch allocation (weights and activations) and the memory held
    outside torch's allocator (CUDA context, cuBLAS and Triton workspaces)."""
    return max(0, int(total * utilization) - peak - outside_torch)


def _decode_first(seq: Sequence, n: int) -> tuple[bool, int]:
    return (n > 1 or seq.is_prefill, seq.num_computed_tokens)
