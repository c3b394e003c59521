"""The `batchpilot serve` flags the operator derives from the spec (passed as flags, or set
through a variable the flag would override), and the rule that keeps engine.extraArgs from
setting them: stated once for the CRD (CEL) and for the operator.

`batchpilot serve` parses with allow_abbrev=False, so an abbreviation (`--max-num-seq=9`)
is an unknown flag there. The rule refuses abbreviations too, so that such a spec is
refused by the API server instead of crash-looping the pods.
"""

from __future__ import annotations

from batchpilot import names

# Engine knobs the spec sets (engine.*), each a flag of the server.
ENGINE_KNOBS = (
    names.MAX_MODEL_LEN,
    names.MAX_NUM_SEQS,
    names.MAX_NUM_BATCHED_TOKENS,
    names.BLOCK_SIZE,
    names.KV_CACHE_DTYPE,
    names.GPU_MEMORY_UTILIZATION,
    names.SWAP_SPACE,
    names.PREEMPTION_MODE,
    names.ENABLE_CHUNKED_PREFILL,
    names.ENABLE_PREFIX_CACHING,
)
BOOL_KNOBS = frozenset([names.ENABLE_CHUNKED_PREFILL.name, names.ENABLE_PREFIX_CACHING.name])

# Multi-LoRA (vLLM's flags). Rendered only while LoRA is on (spec.adapters or
# engine.enableLora): a service without adapters keeps the pod template it had.
ENABLE_LORA = "--enable-lora"
LORA_MODULES = "--lora-modules"
# The adapters new pods start with: the operator passes them through $BATCHPILOT_LORA_MODULES
# (names.LORA_MODULES_ENV, from the ConfigMap), which this flag would override.
PRELOAD_LORA_MODULES = "--preload-lora-modules"
LORA_KNOBS = (names.MAX_LORAS, names.MAX_LORA_RANK, names.MAX_CPU_LORAS)
# spec.adapterResolver's directory (vLLM's filesystem resolver), rendered only with one.
LORA_RESOLVER_DIR = "--lora-resolver-dir"
LORA_RANKS = (8, 16, 32, 64, 128, 256)

MANAGED_FLAGS = tuple(
    sorted(
        [
            "--model",
            "--served-model-name",
            "--host",
            "--port",
            "--admin-port",
            "--dtype",
            "--shutdown-timeout",
            "--max-queue-len",
            "--admin-token",
            ENABLE_LORA,
            "--no-" + ENABLE_LORA[2:],  # would turn LoRA off under the operator's adapters
            LORA_MODULES,
            PRELOAD_LORA_MODULES,
            LORA_RESOLVER_DIR,
            names.SLO_TTFT_FLAG,
            names.SLO_TPOT_FLAG,
        ]
        + [k.flag for k in (*ENGINE_KNOBS, *LORA_KNOBS)]
        + ["--no-" + k.flag[2:] for k in ENGINE_KNOBS if k.name in BOOL_KNOBS]
    )
)


def overrides_managed(arg: str) -> bool:
    """Is ``arg`` a managed flag, one of its `=` forms, or a prefix of one (an abbreviation,
    or a bare `--`)? Values (not starting with `--`) never are."""
    if not arg.startswith("--"):
        return False
    flag = arg.split("=", 1)[0]
    return any(m.startswith(flag) for m in MANAGED_FLAGS)


# The same predicate over the whole list, in CEL (Kubernetes' strings extension: split).
EXTRA_ARGS_CEL = (
    "!has(self.extraArgs) || self.extraArgs.all(a, !a.startsWith('--') || !["
    + ", ".join(f"'{m}'" for m in MANAGED_FLAGS)
    + "].exists(m, m.startsWith(a.split('=')[0])))"
)
EXTRA_ARGS_MESSAGE = (
    "engine.extraArgs may not set, or abbreviate, a flag the operator derives from the spec ("
    + ", ".join(MANAGED_FLAGS)
    + "): set the spec field instead"
)

# The server's KV-cache events: rendered by the operator while the picker it deploys reads
# them (routing's precise prefix scorer), and only then refused in extraArgs; a picker the
# user runs may take them from extraArgs as before.
KV_EVENTS_CONFIG = "--kv-events-config"
KV_EVENTS_CEL = (
    "!has(self.engine.extraArgs) || !self.engine.extraArgs.exists(a, a.startsWith('--') && "
    f"'{KV_EVENTS_CONFIG}'.startsWith(a.split('=')[0]))"
)


def sets_kv_events(args: list[str]) -> bool:
    """Does any of ``args`` set --kv-events-config, or abbreviate it?"""
    return any(a.startswith("--") and KV_EVENTS_CONFIG.startswith(a.split("=", 1)[0]) for a in args)
