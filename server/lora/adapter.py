"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and
checking it against the base model before any tensor reaches the engine: every key, shape
and rank is bounded, and the options batchpilot does not apply are refused by name rather
than silently ignored. Pickled adapter_model.bin files are never opened."""

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchpilot.server.lora import LoRAError

# The PEFT module names a Llama-family decoder layer has, and where they live.
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")  # fmt: skip
MAX_CONFIG_BYTES = 1 << 20
# Options whose effect batchpilot does not reproduce: refusing them keeps the output equal
# to PEFT's for every adapter that loads.
REFUSED = {"use_dora": True, "fan_in_fan_out": True}
_load_ids = itertools.count(1)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    # (layer, module) -> (A [r, d_in], B [d_out, r] already scaled by lora_alpha / r)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Seeds the prefix cache's block chain, so no KV block is shared with the base model
    # or another adapter, nor with an earlier adapter loaded under the same name.
    cache_root: bytes = b""

    def __post_init__(self):
        load_id = next(_load_ids)
        self.cache_root = hashlib.sha256(f"lora\0{self.name}\0{load_id}".encode()).digest()


def load_adapter(name: str, path: str, shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_rank: int) -> LoRAAdapter:  # fmt: skip
    """shapes: PEFT module name -> (d_in, d_out) of the base model's projection; path: a
    directory, or hf://org/name already in the local HF cache (nothing downloads)."""
    root = _local_dir(path)
    config = _read_config(root)
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError(f"adapter {name!r}: lora_alpha must be a positive number")
    pairs = _read_tensors(name, root / "adapter_model.safetensors", shapes, num_layers, max_rank)
    weights = {}
    for key, (a, b) in pairs.items():
        r = a.shape[0]
        scaling = alpha / r**0.5 if config.get("use_rslora") else alpha / r
        weights[key] = (a.float(), b.float() * scaling)
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, str(root), rank, weights)


def _local_dir(path: str) -> Path:
    if not path.startswith("hf://"):
        return Path(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo = path.removeprefix("hf://")
    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as e:
        raise LoRAError(f"adapter {path!r} is not in the local HF cache (nothing is "
                        f"downloaded): {e}") from e  # fmt: skip


def _read_config(root: Path) -> dict:
    file = root / "adapter_config.json"
    if not root.is_dir() or not file.is_file():
        raise LoRAError(f"no PEFT adapter at {str(root)!r}: adapter_config.json not found")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{file}: only LoRA adapters (peft_type LORA) are supported")
    for option, value in REFUSED.items():
        if config.get(option) == value:
            raise LoRAError(f"{file}: {option}={value} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{file}: bias={config['bias']!r} is not supported (only 'none')")
    for option in ("modules_to_save", "alpha_pattern"):
        if config.get(option):
            raise LoRAError(f"{file}: {option} is not supported")
    return config


def _read_tensors(name, file: Path, shapes, num_layers, max_rank) -> dict:
    if not file.is_file():
        raise LoRAError(f"adapter {name!r}: {file.name} not found (only safetensors are read)")
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            parts = {}
            for key in keys:
                layer, module, ab = _parse_key(name, key, shapes, num_layers)
                shape = tuple(f.get_slice(key).get_shape())
                _check_shape(name, key, shape, ab, shapes[module], max_rank)
                parts.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as e:  # a truncated or corrupt file: safetensors raises its own kinds
        raise LoRAError(f"adapter {name!r}: cannot read {file.name}: {e}") from e
    if not parts:
        raise LoRAError(f"adapter {name!r}: {file.name} holds no LoRA weights")
    pairs = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} needs lora_A and lora_B "
                            "of one rank")  # fmt: skip
        pairs[(layer, module)] = (ab["A"], ab["B"])
    return pairs


def _parse_key(name: str, key: str, shapes, num_layers: int) -> tuple[int, str, str]:
    match = KEY.match(key)
    if not match:
        raise LoRAError(f"adapter {name!r}: unsupported weight {key!r}; adapters may target "
                        f"{', '.join(MODULES)} of the decoder layers")  # fmt: skip
    layer, block, module, ab = int(match[1]), match[2], match[3], match[4]
    if MODULES.get(module) != block or module not in shapes:
        raise LoRAError(f"adapter {name!r}: unsupported target module {module!r}")
    if layer >= num_layers:
        raise LoRAError(f"adapter {name!r}: layer {layer} but the base model has {num_layers}")
    return layer, module, ab


def _check_shape(name, key, shape, ab, module_shape, max_rank) -> None:
    if len(shape) != 2:
        raise LoRAError(f"adapter {name!r}: {key} has shape {list(shape)}, not a matrix")
    d_in, d_out = module_shape
    rank = shape[0] if ab == "A" else shape[1]
    expected = (rank, d_in) if ab == "A" else (d_out, rank)
    if shape != expected:
        raise LoRAError(f"adapter {name!r}: {key} has shape {list(shape)}, the base model "
                        f"needs {list(expected)}: was it made for another base model?")  # fmt: skip
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
