"""Resolve a model source and load its weights and tokenizer through transformers.

Sources: None or "bundled", a .gguf file, a transformers model directory (safetensors
or bin), or "hf://org/name" already present in the local HF cache. Nothing downloads.
The bundled GGUF takes ~25 s to dequantize, so it is converted once into a
safetensors directory under the batchpilot cache and loaded from there afterwards.
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from batchpilot.server.config import ConfigError
from batchpilot.server.model.bundled import bundled_model_path
from batchpilot.server.model.plain_tokenizer import PLAIN_CLASSES, open_plain

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
# Near misses, refused with the reason (server/model/llama.py implements none of it).
UNSUPPORTED_REASONS = {
    "gemma2": "Gemma 2 needs logit soft-capping, sliding-window layers and extra norms",
    "gemma3": "Gemma 3 needs sliding-window layers, q/k norms and extra norms",
    "gemma3_text": "Gemma 3 needs sliding-window layers, q/k norms and extra norms",
    "qwen3_moe": "mixture-of-experts layers are not implemented",
}
if TYPE_CHECKING:
    from batchpilot.server.model.llama import LlamaDecoder

LOAD_STAGES = (
    "reading the config and tokenizer",
    "loading weights",
    "building the decoder",
    "allocating the KV cache",
)


class UnsupportedModelError(ValueError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("BATCHPILOT_CACHE", Path.home() / ".cache" / "batchpilot"))


# What the decoder, its RoPE table and the checks read of a Llama config. A config.json
# stating each (as transformers 5 writes them: the RoPE under rope_parameters) reads the
# same as LlamaConfig, whose import costs a server 1.7 s of its start-up on 2 CPUs (any
# config class pulls in torch.distributed.tensor); attributes the decoder reads with a
# default (head_dim, attention_bias, mlp_bias) have LlamaConfig's defaults there.
PLAIN_LLAMA_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "vocab_size",
    "max_position_embeddings", "hidden_act", "tie_word_embeddings", "eos_token_id",
    "rope_parameters",
)  # fmt: skip


def plain_config(source: str, gguf_file: str | None) -> SimpleNamespace | None:
    """A Llama directory's config.json as read, where it states every PLAIN_LLAMA_KEYS and
    a default RoPE; else None (transformers' config class reads it)."""
    path = Path(source) / "config.json"
    if gguf_file or not path.is_file():
        return None
    data = json.loads(path.read_text())
    rope = data.get("rope_parameters")
    if (data.get("model_type") != "llama" or any(k not in data for k in PLAIN_LLAMA_KEYS)
            or "rope_scaling" in data or not isinstance(rope, dict)
            or rope.get("rope_type") != "default" or "rope_theta" not in rope):  # fmt: skip
        return None
    return SimpleNamespace(**data)


def _tokenizer(source: str, gguf_file: str | None):
    # The tokenizers-backed class AutoTokenizer would resolve to loads without the config
    # (AutoTokenizer reads it, and so imports its class, first).
    if not gguf_file and _tokenizer_class(Path(source)) in PLAIN_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)


def serving_tokenizer(source: str, gguf_file: str | None):
    """The tokenizer the server runs: the tokenizers library's own reading of the
    directory's tokenizer.json where that is exactly what transformers would give
    (plain_tokenizer.py: 0.9 s less start-up), else transformers' tokenizer."""
    plain = None if gguf_file else open_plain(Path(source))
    return plain if plain is not None else _tokenizer(source, gguf_file)


def _tokenizer_class(directory: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class where a tokenizer.json is beside it."""
    settings = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").is_file() or not settings.is_file():
        return None
    return json.loads(settings.read_text()).get("tokenizer_class")


def _hf_model(source: str, gguf_file: str | None, dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(
        source, local_files_only=True, dtype=dtype, **kwargs
    )


def _from_pretrained(source: str, gguf_file: str | None, dtype):
    tokenizer = _tokenizer(source, gguf_file)
    return _hf_model(source, gguf_file, dtype), tokenizer


def _converted_bundled_dir() -> Path:
    import torch

    gguf = bundled_model_path()
    target = cache_root() / "models" / f"{gguf.stem}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    model, tokenizer = _from_pretrained(str(gguf.parent), gguf.name, torch.float32)
    # The weights are already dequantized; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_source(model: str | None) -> tuple[str, str | None]:
    """-> (directory or HF id, gguf file name or None)."""
    if model in (None, "", "bundled"):
        return str(_converted_bundled_dir()), None
    if model.startswith("hf://"):
        return model.removeprefix("hf://"), None
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist")
        return str(path.parent), path.name
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is neither a directory, a .gguf file, 'bundled' nor hf://org/name"
        )
    return str(path), None


def check_supported(config) -> None:
    from batchpilot.server.model.llama import ACTIVATIONS

    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None)
        reason = UNSUPPORTED_REASONS.get(model_type)
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r} ({archs}){f': {reason}' if reason else ''}"
            f"; batchpilot runs Llama-family decoders: {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(gemma is Gemma 1 only: gemma2 and gemma3 are not supported)"
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"unsupported MLP activation hidden_act={act!r}; the decoder implements "
            f"{', '.join(ACTIVATIONS)}"
        )
    if getattr(config, "use_bidirectional_attention", None):
        raise UnsupportedModelError("bidirectional attention is not supported (causal only)")


def read_config(source: str, gguf_file: str | None):
    """The transformers config of a resolved source (or plain_config's reading of it),
    refused unless supported."""
    hf_config = plain_config(source, gguf_file)
    if hf_config is None:
        from transformers import AutoConfig

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        hf_config = AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
    check_supported(hf_config)
    return hf_config


def load_hf_model(model: str | None, dtype):
    """-> (transformers model in eval mode, tokenizer)."""
    source, gguf_file = resolve_source(model)
    read_config(source, gguf_file)
    hf_model, tokenizer = _from_pretrained(source, gguf_file, dtype)
    return hf_model.eval(), tokenizer


@dataclass
class LoadedModel:
    decoder: "LlamaDecoder"
    tokenizer: object
    eos_token_ids: set[int]
    vocab_size: int


def load_model(config, dtype, device, stage) -> LoadedModel:
    """Weights and tokenizer for config.model, checked against the config, as a decoder on
    device; fills config's model-dependent defaults. stage(name) marks LOAD_STAGES.

    A safetensors directory (the bundled model's converted cache among them) is mapped
    straight into the decoder (checkpoint.py); anything else loads through transformers."""
    from batchpilot.server.model.build import made_in_place
    from batchpilot.server.model.checkpoint import open_checkpoint
    from batchpilot.server.model.llama import from_hf

    stage(LOAD_STAGES[0])
    source, gguf_file = resolve_source(config.model)
    hf_config = read_config(source, gguf_file)
    config.resolve(hf_config.max_position_embeddings, device.type)
    check_sliding_window(hf_config, config.max_model_len)
    tokenizer = serving_tokenizer(source, gguf_file)
    stage(LOAD_STAGES[1])
    weights = None if gguf_file else open_checkpoint(source, hf_config)
    if weights is None:
        weights = _hf_model(source, gguf_file, dtype)
    stage(LOAD_STAGES[2])
    with made_in_place(dtype, device):
        decoder = from_hf(weights, config.max_model_len, dtype, device)
    eos = eos_token_ids(weights, tokenizer)
    return LoadedModel(decoder, tokenizer, eos, hf_config.vocab_size)


def eos_token_ids(hf_model, tokenizer) -> set[int]:
    """Every id the model's configs or tokenizer call end-of-sequence."""
    ids = set()
    for source in (hf_model.generation_config, hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return ids


def check_sliding_window(hf_config, max_model_len: int) -> None:
    """Sliding-window attention is not implemented; within the window it is plain
    causal attention, so such models run exactly up to the window."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) and window and max_model_len > window:
        raise ConfigError(
            f"this model uses sliding-window attention (window {window}), which batchpilot "
            f"does not implement: set max_model_len <= {window}"
        )
