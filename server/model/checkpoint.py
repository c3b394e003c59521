"""A safetensors checkpoint mapped straight into the decoder, without transformers' model.

transformers' from_pretrained costs the serve path an import of the family's modeling code
(about 1 s on 2 CPUs, most of it transformers' own machinery) and a second model in
memory. Here each file is mapped (nothing is read or copied up front): from_hf's copy into
each final parameter is the one pass over the weights, converting the dtype on the way.

Used only where it reads exactly what transformers would: a safetensors directory in
transformers' own tensor names, and a RoPE whose table does not change with the sequence
length. Everything else (GGUF, .bin weights, checkpoints transformers renames on load,
dynamic RoPE) goes through transformers (open_checkpoint returns None)."""

import json
import mmap
from pathlib import Path
from types import SimpleNamespace

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip
# A name every supported family has in transformers' layout; a checkpoint without it is
# in another layout, which transformers would map on load.
LAYOUT_PROBE = "model.layers.0.self_attn.q_proj.weight"


class Checkpoint:
    """What from_hf and loader.eos_token_ids read of a transformers model."""

    def __init__(self, config, tensors: dict[str, torch.Tensor], generation_config):
        self.config = config
        self.generation_config = generation_config
        self.model = SimpleNamespace(rotary_emb=RotaryTable(config))
        self._tensors = tensors

    def named_parameters(self):
        return self._tensors.items()

    def named_buffers(self):
        return ()


def open_checkpoint(source: str, config) -> Checkpoint | None:
    """The checkpoint in directory source, mapped; None where transformers must load it."""
    files = safetensors_files(Path(source))
    if not files or not static_rope(config):
        return None
    tensors = {}
    for path in files:
        tensors.update(map_safetensors(path))
    if LAYOUT_PROBE not in tensors:
        return None
    generation = Path(source) / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    return Checkpoint(config, tensors, SimpleNamespace(eos_token_id=eos))


def safetensors_files(directory: Path) -> list[Path]:
    """One file, or the shards a model.safetensors.index.json lists; [] for neither."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of the file's pages. ACCESS_COPY maps
    it private and writable: torch wants a writable buffer, and nothing reaches the file."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    size = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8 : 8 + size])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        start, end = info["data_offsets"]
        if end == start:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize,
                                offset=8 + size + start)  # fmt: skip
        out[name] = flat.view(shape)
    return out


def static_rope(config) -> bool:
    """Whether RotaryTable computes this config's RoPE as transformers does: any type but
    those whose frequencies transformers recomputes as the sequence grows."""
    rope = getattr(config, "rope_parameters", None)
    kind = rope.get("rope_type") if isinstance(rope, dict) else None
    return isinstance(kind, str) and "dynamic" not in kind and "longrope" not in kind


class RotaryTable:
    """transformers' rotary embedding, the same code in every supported family, for
    LlamaDecoder.build_rope: its cos and sin at the given positions."""

    def __init__(self, config):
        rope = config.rope_parameters
        if rope["rope_type"] == "default":
            dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads
            )
            base = rope["rope_theta"]
            self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
            self.inv_freq, self.attention_scaling = init(config)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
