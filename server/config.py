"""EngineConfig: every engine knob, defined once for the CLI, LLM(...) and the admin API."""

import argparse
import dataclasses
from dataclasses import dataclass, field

from batchpilot import names

GiB = 1 << 30


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 where the hardware has fast bf16, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: min(model's limit, 4096)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len w/o chunking
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # CPU default 1 GiB; on CUDA overrides util
    gpu_memory_utilization: float = 0.9
    swap_space_bytes: int = 4 * GiB
    preemption_mode: str = "swap"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # "static" admits a whole batch only when the previous one has finished: it exists
    # so benchmarks can compare against static batching inside the same engine.
    scheduling_policy: str = "continuous"
    seed: int = 0
    served_model_name: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        checks = [
            (
                self.kv_cache_dtype in names.KV_CACHE_DTYPES,
                f"kv_cache_dtype must be one of {names.KV_CACHE_DTYPES}",
            ),
            (
                self.preemption_mode in names.PREEMPTION_MODES,
                f"preemption_mode must be one of {names.PREEMPTION_MODES}",
            ),
            (self.dtype in names.DTYPES, f"dtype must be one of {names.DTYPES}"),
            (self.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda"),
            (
                self.scheduling_policy in ("continuous", "static"),
                "scheduling_policy must be continuous or static",
            ),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (
                self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
                "block_size must be a power of two <= 128",
            ),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.swap_space_bytes >= 0, "swap_space must be >= 0"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (
                self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                "kv_cache_memory must be > 0",
            ),
            (
                self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                "max_num_batched_tokens must be >= 1",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def resolve(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the model, then check the combination."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, 4096)
        if self.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's limit {model_max_len}"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                f"({self.max_model_len}) needs --enable-chunked-prefill: a prompt would never fit"
            )
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_num_seqs)

    def public(self) -> dict:
        """The settings in force, as the admin API and logs show them."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"
        }


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model dir, .gguf file, hf://org/name "
        "(pre-cached) or 'bundled' (default: bundled SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="auto", choices=names.DTYPES)
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument(names.MAX_MODEL_LEN.flag, type=int, default=None)
    g.add_argument(names.MAX_NUM_SEQS.flag, type=int, default=d["max_num_seqs"].default)
    g.add_argument(names.MAX_NUM_BATCHED_TOKENS.flag, type=int, default=None)
    g.add_argument(names.BLOCK_SIZE.flag, type=int, default=d["block_size"].default)
    g.add_argument(names.KV_CACHE_DTYPE.flag, default="auto", choices=names.KV_CACHE_DTYPES)
    g.add_argument(names.GPU_MEMORY_UTILIZATION.flag, type=float, default=0.9)
    g.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV cache size, e.g. 2GiB (CPU default 1GiB; on CUDA overrides "
        "--gpu-memory-utilization)",
    )
    g.add_argument(names.SWAP_SPACE.flag, type=float, default=4.0, help="CPU swap space, GiB")
    g.add_argument(names.PREEMPTION_MODE.flag, default="swap", choices=names.PREEMPTION_MODES)
    g.add_argument(
        names.ENABLE_CHUNKED_PREFILL.flag, default=True, action=argparse.BooleanOptionalAction
    )
    g.add_argument(
        names.ENABLE_PREFIX_CACHING.flag, default=True, action=argparse.BooleanOptionalAction
    )
    g.add_argument("--scheduling-policy", default="continuous", choices=("continuous", "static"))
    g.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space_bytes=int(args.swap_space * GiB),
        preemption_mode=args.preemption_mode,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        served_model_name=getattr(args, "served_model_name", None),
    )
