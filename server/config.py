"""EngineConfig: every engine knob, defined once. Each field carries its help text and
choices; `batchpilot serve`'s engine flags, LLM(...) and the admin API all come from
here, as vLLM's EngineArgs does it."""

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from batchpilot import names
from batchpilot.server.kv.events_config import KVEventsConfig, parse_kv_events_config

GiB = 1 << 30
MAX_RESOLVER_DIR_CHARS = 4096


class ConfigError(ValueError):
    pass


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def knob(default, help: str, *, choices: tuple | None = None, flag: str | None = None,
         parse: typing.Callable[[str], object] | None = None, unit: int | None = None):  # fmt: skip
    """A config field and its `batchpilot serve` flag. flag defaults to --field-name;
    parse turns the flag's text into the field's value; unit: the flag counts in units of
    this many (bytes), the field in ones."""
    meta = {"help": help, "choices": choices, "flag": flag, "parse": parse, "unit": unit}
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model: str | None = knob(None, "HF model dir, .gguf file, hf://org/name (pre-cached) or "
                             "'bundled' (default: the bundled SmolLM2-135M-Instruct)")  # fmt: skip
    dtype: str = knob("auto", "auto: bfloat16 where the hardware computes it fast, else "
                      "float16 on GPUs and float32 on CPUs", choices=names.DTYPES)  # fmt: skip
    device: str = knob("auto", "auto: cuda when available, else cpu", choices=names.DEVICES)
    max_model_len: int | None = knob(None, "longest prompt plus output, in tokens "
                                     "(default: the model's limit, at most 4096)")  # fmt: skip
    max_num_seqs: int = knob(64, "most sequences in one step; changes live (/admin/config)")
    max_num_batched_tokens: int | None = knob(None, "token budget of one step (default: 2048 "
                                              "on GPUs, 512 on CPUs; max_model_len without "
                                              "chunked prefill); changes live (/admin/config) "
                                              "up to the value started with")  # fmt: skip
    block_size: int = knob(16, "tokens per KV-cache block", choices=names.BLOCK_SIZES)
    kv_cache_dtype: str = knob("auto", "auto: the model dtype; fp8 (e4m3) halves bf16's "
                               "footprint", choices=names.KV_CACHE_DTYPES)  # fmt: skip
    kv_cache_memory_bytes: int | None = knob(
        None, "KV cache size, e.g. 2GiB (CPU default 1GiB; on CUDA overrides "
        "--gpu-memory-utilization)", flag="--kv-cache-memory", parse=parse_bytes
    )  # fmt: skip
    gpu_memory_utilization: float = knob(0.9, "fraction of GPU memory for weights, "
                                         "activations and the KV cache")  # fmt: skip
    swap_space_bytes: int = knob(4 * GiB, "CPU swap space for preempted sequences, GiB",
                                 flag=names.SWAP_SPACE.flag, unit=GiB)  # fmt: skip
    preemption_mode: str = knob("swap", "what happens to a preempted sequence's KV: swap to "
                                "CPU, or recompute it later", choices=names.PREEMPTION_MODES)  # fmt: skip
    enable_chunked_prefill: bool = knob(True, "split long prompts over steps")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of shared prompt prefixes")
    attention_backend: str = knob("auto", "auto: Triton kernels on CUDA GPUs that support "
                                  "them (sm80+); on CPUs the C++ decode kernel or the torch "
                                  "reference, whichever a timing at start-up finds faster "
                                  "(cached per machine); torch, triton and cpu_kernel force "
                                  "one",
                                  choices=("auto", "torch", "triton", "cpu_kernel"))  # fmt: skip
    linear_backend: str = knob("auto", "auto: on CPUs in float32, oneDNN's linear with the "
                               "weights prepacked at load where a timing at start-up finds "
                               "it faster than torch's (cached per machine), else torch's; "
                               "torch and onednn (CPU only) force one",
                               choices=("auto", "torch", "onednn"))  # fmt: skip
    # On by default, as in vLLM (whose --enforce-eager turns them off): on an H200 one
    # stream decoded 13x faster with them (benchmarks/README.md, GPU). No effect on CPUs.
    cuda_graphs: bool = knob(True, "replay decode-only steps from CUDA graphs captured at "
                             "bucketed batch sizes (CUDA with Triton attention)")  # fmt: skip
    # "static" admits a whole batch only when the previous one has finished: it exists
    # so benchmarks can compare against static batching inside the same engine.
    scheduling_policy: str = knob("continuous", "continuous, or static batching for comparison",
                                  choices=names.SCHEDULING_POLICIES)  # fmt: skip
    seed: int | None = knob(None, "seeds the per-request seeds of requests that bring none "
                            "(default: drawn from the OS, so that replicas and restarts "
                            "differ and no client can predict another's samples)")  # fmt: skip
    logprobs_mode: str = knob("raw_logprobs", "what logprobs report: the raw model's "
                              "distribution, or the one each token was drawn from (after "
                              "logit_bias, penalties, temperature, min_p, top-k/top-p)",
                              choices=("raw_logprobs", "processed_logprobs"))  # fmt: skip
    enable_lora: bool = knob(False, "serve PEFT LoRA adapters over the base model "
                             "(implied by --lora-modules)")  # fmt: skip
    max_loras: int = knob(1, "most distinct adapters in one step (their weights are held on "
                          "the device)")  # fmt: skip
    max_lora_rank: int = knob(16, "highest adapter rank accepted; the device slots are sized "
                              "for it")  # fmt: skip
    max_cpu_loras: int | None = knob(None, "most adapters loaded at once, held in host "
                                     "memory; more may be registered, the least recently "
                                     "used are read again when wanted (default: "
                                     "max_loras, as vLLM's)")  # fmt: skip
    # vLLM's filesystem resolver (VLLM_LORA_RESOLVER_CACHE_DIR, which `serve` reads too).
    lora_resolver_dir: str | None = knob(None, "directory of PEFT adapters, one per "
                                         "subdirectory: a request naming an adapter that "
                                         "is not loaded loads <dir>/<name> on first use "
                                         "(or $VLLM_LORA_RESOLVER_CACHE_DIR); implies "
                                         "--enable-lora")  # fmt: skip
    # knob() only declares the field (RUF009 cannot know the frozen KVEventsConfig).
    kv_events_config: KVEventsConfig | None = knob(  # noqa: RUF009
        None, "vLLM's KV-cache events, as JSON with vLLM's fields, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"topic": "kv@$(POD_IP)@model"}\': the blocks the prefix cache stores and drops, '
        "for a prefix-aware router (docs/routing.md)", parse=str,
    )  # fmt: skip
    cpu_threads: int | None = knob(None, "torch threads on CPU (default: from the cgroup CPU "
                                   "quota capped by the CPU affinity; $BATCHPILOT_CPU_THREADS, "
                                   "then $OMP_NUM_THREADS, override that default)")  # fmt: skip
    served_model_name: str | None = knob(
        None, f"name clients use (default: {names.DEFAULT_SERVED_MODEL_NAME} for the bundled "
        "model, else the model path's last component)"
    )  # fmt: skip

    def __post_init__(self):
        if self.lora_resolver_dir:  # adapters load on first use: LoRA must be on
            self.enable_lora = True
        if self.kv_events_config is not None:  # the flag's JSON, a dict, or already parsed
            try:
                self.kv_events_config = parse_kv_events_config(self.kv_events_config)
            except ValueError as error:  # json.JSONDecodeError too
                raise ConfigError(str(error)) from None
        self.validate()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name} must be one of {choices}")
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.swap_space_bytes >= 0, "swap_space must be >= 0"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "kv_cache_memory must be > 0"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens must be >= 1"),
            (1 <= self.max_loras <= 256, "max_loras must be in [1, 256]"),
            (1 <= self.max_lora_rank <= 512, "max_lora_rank must be in [1, 512]"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             "max_cpu_loras must be >= max_loras"),
            (self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1"),
            (self.lora_resolver_dir is None
             or 0 < len(self.lora_resolver_dir) <= MAX_RESOLVER_DIR_CHARS,
             f"lora_resolver_dir must be 1 to {MAX_RESOLVER_DIR_CHARS} characters"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def resolve(self, model_max_len: int, device_type: str) -> None:
        """Fill the defaults that depend on the model and device, then check the combination."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, 4096)
        if self.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's limit {model_max_len}"
            )
        if self.linear_backend == "onednn" and device_type != "cpu":
            raise ConfigError("linear_backend onednn runs on CPUs only")
        if self.max_num_batched_tokens is None:
            defaults = names.DEFAULT_STEP_TOKENS
            budget = defaults.get(device_type, defaults["cpu"])
            if not self.enable_chunked_prefill:
                budget = max(budget, self.max_model_len)
            self.max_num_batched_tokens = budget
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                f"({self.max_model_len}) needs --enable-chunked-prefill: a prompt would never fit"
            )
        self.apply_live_change({})

    @property
    def lora_capacity(self) -> int:
        """The most adapters loaded at once: max_cpu_loras, else max_loras (vLLM's default:
        adapters past it are evicted least recently used first and read again when wanted)."""
        return self.max_cpu_loras or self.max_loras

    def live_change(self, changes: dict, max_num_seqs_limit: int | None = None,
                    max_step_tokens: int | None = None) -> dict:  # fmt: skip
        """Check a change to the knobs that change while serving (names.LIVE_KNOBS);
        -> every field update it implies. Raises ConfigError, changing nothing.
        max_num_seqs_limit: the most sequences the running engine can hold (its KV blocks
        and the step budget it was profiled with); max_step_tokens: that profiled step
        budget. Both None before the engine exists."""
        unknown = sorted(set(changes) - set(names.LIVE_KNOBS))
        if unknown:
            raise ConfigError(f"{', '.join(unknown)} cannot be changed while the server runs; "
                              f"live: {', '.join(names.LIVE_KNOBS)}")  # fmt: skip
        for name, value in changes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        seqs = changes.get("max_num_seqs", self.max_num_seqs)
        if max_num_seqs_limit is not None and seqs > max_num_seqs_limit:
            raise ConfigError(
                f"max_num_seqs {seqs} is more than this replica can hold: at most "
                f"{max_num_seqs_limit} (one KV block each, one token each in the "
                f"{max_step_tokens or self.max_num_batched_tokens}-token step it was started "
                "with); restart it with a larger --kv-cache-memory or --max-num-batched-tokens "
                "for more"
            )
        if "max_num_batched_tokens" in changes:
            batched = changes["max_num_batched_tokens"]
            self._check_step_budget(batched, seqs, max_step_tokens)
        else:
            # A step must have room for one token of every sequence it runs: raising
            # max_num_seqs alone raises the budget with it (within the profiled one, as
            # max_num_seqs_limit is).
            batched = max(self.max_num_batched_tokens or seqs, seqs)
        return {"max_num_seqs": seqs, "max_num_batched_tokens": batched}

    def _check_step_budget(self, batched: int, seqs: int, max_step_tokens: int | None) -> None:
        """A step budget asked for explicitly: never past the one the engine profiled (which
        sized its activations and, on GPUs, the KV cache), whole prompts without chunked
        prefill, and one token of every running sequence."""
        if max_step_tokens is not None and batched > max_step_tokens:
            raise ConfigError(
                f"max_num_batched_tokens {batched} is more than the {max_step_tokens}-token "
                "step this replica was started (profiled) with; restart it with a larger "
                "--max-num-batched-tokens for more"
            )
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and batched < self.max_model_len):  # fmt: skip
            raise ConfigError(
                f"max_num_batched_tokens {batched} < max_model_len {self.max_model_len} needs "
                "--enable-chunked-prefill: a full-length prompt would never fit in one step"
            )
        if batched < seqs:
            raise ConfigError(
                f"max_num_batched_tokens {batched} < max_num_seqs {seqs}: a step must hold one "
                "token of every running sequence; lower max_num_seqs in the same change"
            )

    def apply_live_change(self, changes: dict, max_num_seqs_limit: int | None = None,
                          max_step_tokens: int | None = None) -> None:  # fmt: skip
        updates = self.live_change(changes, max_num_seqs_limit, max_step_tokens)
        for name, value in updates.items():
            setattr(self, name, value)

    def public(self) -> dict:
        """The settings in force, as the admin API and logs show them."""
        return dataclasses.asdict(self)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, from the field's type, default and metadata."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs = {"dest": f.name, "default": f.default, "choices": meta["choices"],
                  "help": _help(f)}  # fmt: skip
        if meta["flag"]:  # named after the flag, not the field (KV_CACHE_MEMORY, not ..._BYTES)
            kwargs["metavar"] = meta["flag"].removeprefix("--").replace("-", "_").upper()
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["parse"] or _flag_type(f.type, meta["unit"])
        group.add_argument(flag, **kwargs)


def _help(f: dataclasses.Field) -> str:
    default = f.default / f.metadata["unit"] if f.metadata["unit"] else f.default
    if default is None:
        return f.metadata["help"]
    if isinstance(default, float):
        default = f"{default:g}"
    return f"{f.metadata['help']} (default: {default})"


def _flag_type(annotation, unit: int | None):
    base = next(t for t in typing.get_args(annotation) or (annotation,) if t is not type(None))
    return (lambda text: int(float(text) * unit)) if unit else base


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if hasattr(args, f.name)})  # fmt: skip
