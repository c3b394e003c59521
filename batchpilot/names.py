"""Names shared by the server and the operator. Dependency-free on purpose: the operator
imports it without pulling in torch.

Each engine knob has one snake_case name (EngineConfig field, admin API key, metric label),
one CLI flag derived from it, and one camelCase CRD field.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    crd_field: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


MAX_MODEL_LEN = Knob("max_model_len", "maxModelLen")
MAX_NUM_SEQS = Knob("max_num_seqs", "maxNumSeqs")
MAX_NUM_BATCHED_TOKENS = Knob("max_num_batched_tokens", "maxNumBatchedTokens")
# The step budget when none is given, by device (with chunked prefill): the server starts
# with it, and the operator's twin assumes the GPU's when no replica reports its own. A CPU
# computes a 2048-token step in over a second: when 16 closed-loop requests arrive
# together, their prefills filled one such step and every stream waited for it (guidellm:
# TTFT 1.7-2.0 s against 0.15 s alone); 512 spreads them over shorter steps (0.68-0.75 s,
# throughput the same within the noise).
DEFAULT_STEP_TOKENS = {"cuda": 2048, "cpu": 512}
KV_CACHE_DTYPE = Knob("kv_cache_dtype", "kvCacheDtype")
GPU_MEMORY_UTILIZATION = Knob("gpu_memory_utilization", "gpuMemoryUtilization")
BLOCK_SIZE = Knob("block_size", "blockSize")
PREEMPTION_MODE = Knob("preemption_mode", "preemptionMode")
ENABLE_CHUNKED_PREFILL = Knob("enable_chunked_prefill", "enableChunkedPrefill")
ENABLE_PREFIX_CACHING = Knob("enable_prefix_caching", "enablePrefixCaching")
# vLLM's --swap-space is in GiB; the engine stores bytes.
SWAP_SPACE = Knob("swap_space", "swapSpaceGiB")
# Multi-LoRA, vLLM's names.
MAX_LORAS = Knob("max_loras", "maxLoras")
MAX_LORA_RANK = Knob("max_lora_rank", "maxLoraRank")
MAX_CPU_LORAS = Knob("max_cpu_loras", "maxCpuLoras")

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
PREEMPTION_MODES = ("swap", "recompute")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
SCHEDULING_POLICIES = ("continuous", "static")

# Knobs the admin API changes while the server runs.
LIVE_KNOBS = (MAX_NUM_SEQS.name, MAX_NUM_BATCHED_TOKENS.name)

ADMIN_TOKEN_ENV = "BATCHPILOT_ADMIN_TOKEN"
# The CPU engine's thread count (server/platform/cpu_budget.py); the operator sets it on CPU pods
# from their CPU limit or request.
CPU_THREADS_ENV = "BATCHPILOT_CPU_THREADS"
# The adapters a replica loads at start-up where a bad one only logs (--preload-lora-modules):
# the operator sets it from spec.adapters, through the service's ConfigMap.
LORA_MODULES_ENV = "BATCHPILOT_LORA_MODULES"
DEFAULT_PORT = 8000
# /admin/* listens here only, never on the public port; the Service does not expose it and
# the operator reaches each pod on it directly.
DEFAULT_ADMIN_PORT = 8001
DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"

# Prometheus metric names: vLLM's where vLLM has one, so existing dashboards, KEDA
# triggers and the Gateway API inference extension work unchanged.
METRIC_LABEL = "model_name"
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_REQUESTS_SWAPPED = "vllm:num_requests_swapped"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CPU_CACHE_USAGE = "vllm:cpu_cache_usage_perc"
NUM_PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
# vLLM v1's prefix-cache counters, in prompt tokens: looked up at admission, and of those
# found in cached blocks (hit rate = hits / queries over a window).
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
SWAPS_OUT = "batchpilot:swaps_out_total"
SWAPS_IN = "batchpilot:swaps_in_total"
MAX_NUM_SEQS_METRIC = "batchpilot:max_num_seqs"
MAX_NUM_BATCHED_TOKENS_METRIC = "batchpilot:max_num_batched_tokens"
KV_CACHE_INFO = "batchpilot:kv_cache_info"
# vLLM's cache-config info family; GIE's endpoint picker reads block_size and num_gpu_blocks.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
BATCH_SIZE = "batchpilot:batch_size"
# For the closed loop's models of step time and of the workload (operator/loop/observe.py).
# vLLM v1's per-request histograms, observed when a request finishes: mean time per output
# token after the first (requests with two or more), prompt and output lengths.
REQUEST_TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
# Requests accepted into the engine (vLLM counts none).
REQUEST_ARRIVALS = "batchpilot:request_arrivals_total"
# Age of the oldest request waiting to be scheduled; 0 when none waits.
OLDEST_WAITING_SECONDS = "batchpilot:oldest_waiting_seconds"
# The service's SLO, per request as clients see it: the operator passes spec.slo's targets to
# a tuned service's pods, and the server counts each finished request against both, so the
# loop's score is exact wherever a vLLM histogram bucket straddles a target (TPOT's run
# 25 -> 50 ms). Not in ALL_METRICS: they exist only with the targets given.
# Server flags (spec.slo.timeToFirstTokenSeconds and .interTokenLatencySeconds), not engine
# knobs: they change what is counted, never what is scheduled.
SLO_TTFT_FLAG = "--slo-time-to-first-token-seconds"
SLO_TPOT_FLAG = "--slo-inter-token-latency-seconds"
SLO_REQUESTS = "batchpilot:slo_requests_total"  # finished requests judged against the SLO
SLO_REQUESTS_MET = "batchpilot:slo_requests_met_total"  # of those, within both targets
# Step cost, by the labels below: the step's batch size rounded up to a bucket ("+Inf" past
# the last) and whether it carried prompt tokens. A label set exists once a step had it,
# so these are not in ALL_METRICS.
STEP_BATCH_LABEL = "batch"
STEP_PHASE_LABEL = "phase"
STEP_PHASE_DECODE = "decode"  # no prompt tokens in the step
STEP_PHASE_MIXED = "mixed"  # some prompt (prefill) tokens in the step
ENGINE_STEPS = "batchpilot:engine_steps_total"
ENGINE_STEP_SECONDS = "batchpilot:engine_step_seconds_total"
ENGINE_STEP_SEQUENCES = "batchpilot:engine_step_sequences_total"
ENGINE_STEP_DECODE_SEQUENCES = "batchpilot:engine_step_decode_sequences_total"
ENGINE_STEP_PREFILL_TOKENS = "batchpilot:engine_step_prefill_tokens_total"
ENGINE_STEP_CONTEXT_TOKENS = "batchpilot:engine_step_context_tokens_total"
# The CUDA-graph capture sizes in force (server/model/cuda_graphs.py), once captured: a step
# of n decoding sequences runs as the smallest size that holds n (the rows past n are
# padding), a step past the largest unpadded. "steps" says which steps are padded: the
# server's decode-only ones (STEP_PHASE_DECODE), or every step with decodes ("all", as
# vLLM's piecewise graphs pad mixed batches too). The loop's step model pads as they do
# (operator/loop/plant.py). Not in ALL_METRICS: it exists only with graphs captured.
DECODE_GRAPHS_INFO = "batchpilot:decode_graphs_info"
GRAPH_SIZES_LABEL = "batch_sizes"  # ascending, comma-joined
GRAPH_STEPS_LABEL = "steps"
GRAPH_STEPS_ALL = "all"
# Buckets of these families, here so that the server (server/api/metrics.py) and the
# simulator (benchmarks/loopsim/metrics.py) share them. TPOT: vLLM's. Token counts: vLLM's
# build_1_2_5_buckets, up to past any max_model_len served. Batch: the step's batch label.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                         50000, 100000)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def step_batch_label(batch_size: int) -> str:
    """The batch label of a step of batch_size sequences: the smallest of BATCH_BUCKETS
    that holds it, "+Inf" past the last."""
    for bound in BATCH_BUCKETS:
        if batch_size <= bound:
            return str(bound)
    return "+Inf"


def step_phase_label(prefill_tokens: int) -> str:
    return STEP_PHASE_MIXED if prefill_tokens > 0 else STEP_PHASE_DECODE


STEP_COUNTERS = (
    ENGINE_STEPS,
    ENGINE_STEP_SECONDS,
    ENGINE_STEP_SEQUENCES,
    ENGINE_STEP_DECODE_SEQUENCES,
    ENGINE_STEP_PREFILL_TOKENS,
    ENGINE_STEP_CONTEXT_TOKENS,
)
# vLLM's LoRA gauge, which GIE's endpoint picker reads for adapter affinity: its value is a
# timestamp, its labels the state (max_lora, the comma-joined running_lora_adapters and
# waiting_lora_adapters). Not in ALL_METRICS: it exists only with LoRA on, and carries no
# model_name label.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"

ALL_METRICS = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_SWAPPED,
    KV_CACHE_USAGE,
    CPU_CACHE_USAGE,
    NUM_PREEMPTIONS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    ITERATION_TOKENS,
    SWAPS_OUT,
    SWAPS_IN,
    MAX_NUM_SEQS_METRIC,
    MAX_NUM_BATCHED_TOKENS_METRIC,
    KV_CACHE_INFO,
    CACHE_CONFIG_INFO,
    BATCH_SIZE,
    REQUEST_TIME_PER_OUTPUT_TOKEN,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_ARRIVALS,
    OLDEST_WAITING_SECONDS,
)
