"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Gemma) running on the
paged KV cache: RMSNorm, RoPE with the model's scaling config, GQA, gated MLP, tied or
untied embeddings. Weights come from a loaded transformers model; q/k/v and gate/up are
fused so each layer runs four matmuls. A step with LoRA rows adds each row's adapter
product after each of the four (lora/slots.py).

Per-family switches, read from the config (`Family`): Qwen2's q/k/v bias, Qwen3's
per-head RMSNorm on q and k before RoPE, Gemma's (1 + weight) RMSNorm, sqrt(hidden)
embedding scale and tanh-GELU MLP."""

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from batchpilot.server.attention import attention
from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache
from batchpilot.server.lora.slots import LoRABatch
from batchpilot.server.model import cpu_norm, cpu_rope

# config.hidden_act -> the MLP's gate activation (transformers' ACT2FN names).
ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu_pytorch_tanh": partial(nn.functional.gelu, approximate="tanh"),
}


@dataclass(frozen=True)
class Family:
    """What sets a model family apart from Llama, read from its transformers config."""

    qkv_bias: bool  # Qwen2 (or attention_bias): biases on q, k and v
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, after the reshape, before RoPE
    norm_offset: bool  # Gemma: RMSNorm scales by (1 + weight), in float32
    embed_scale: bool  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    act: str  # the MLP's gate activation, a key of ACTIVATIONS

    @classmethod
    def of(cls, cfg) -> "Family":
        kind = cfg.model_type
        return cls(
            qkv_bias=getattr(cfg, "attention_bias", False) or kind == "qwen2",
            qk_norm=kind == "qwen3",
            norm_offset=kind == "gemma",
            embed_scale=kind == "gemma",
            act=getattr(cfg, "hidden_act", "silu"),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """-> (the norm of x + residual, x + residual), as vLLM's fused RMSNorm returns;
        x + residual is rounded to x's dtype first, as transformers' residual add is."""
        if cpu_norm.usable(x, self.weight):
            return cpu_norm.add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers (float32 statistics) so greedy outputs match.
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: (x * (1 + w)) in float32, then cast
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, bit for bit, in four ops instead of
    seven: rotate_half(x) * sin is x's halves swapped times sin with its first half
    negated (a negation is exact), which build_rope stores."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1) * sin_signed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, index: int):
        super().__init__()
        self.index = index
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        family = Family.of(cfg)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=family.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        mlp_bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=mlp_bias)
        self.act = ACTIVATIONS[family.act]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, family.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                family.norm_offset)  # fmt: skip
        self.qk_norm = family.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.splits = (q, kv, kv)
        self.qk_v = (q + kv, kv)

    def forward(self, x, residual, cos, sin, kv: KVCache, meta: AttentionMetadata,
                lora: LoRABatch | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x: the previous layer's MLP output (the embeddings, with residual None) ->
        (this layer's MLP output, the residual stream before it): each residual add is
        fused into the norm after it."""
        h, residual = self.input_layernorm(x, residual)
        qk, v = self._project("qkv_proj", h, lora).split(self.qk_v, dim=-1)
        n, heads = x.shape[0], self.num_heads
        qk = qk.view(n, heads + self.num_kv_heads, self.head_dim)  # q and k rotate as one
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :heads])[0], self.k_norm(qk[:, heads:])[0]), dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        cached = cpu_rope.usable(qk, kv, meta)
        if cached:  # rotated in place, k and v written: one call for nine torch ops
            cpu_rope.rope_and_cache(qk, v, cos, sin, kv, self.index, meta.slot_mapping, heads)
        else:
            qk = rotate(qk, cos, sin)
        attn = attention(qk[:, :heads], qk[:, heads:], v, kv, self.index, meta, self.scale,
                         cached)  # fmt: skip
        h, residual = self.post_attention_layernorm(self._project("o_proj", attn, lora), residual)
        gate, up = self._project("gate_up_proj", h, lora).chunk(2, dim=-1)
        return self._project("down_proj", self.act(gate).mul_(up), lora), residual

    def _project(self, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        y = getattr(self, name)(x)
        if lora is not None:
            lora.add(y, x, self.index, name)
        return y


class LlamaDecoder(nn.Module):
    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        family = Family.of(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, family.norm_offset)
        # Gemma: sqrt(hidden) as a float32 tensor cast to the model dtype (bf16: 55.5, not
        # 55.43, for hidden 3072), as transformers computes it; .to(dtype) casts the buffer.
        scale = torch.tensor(cfg.hidden_size**0.5) if family.embed_scale else None
        self.register_buffer("embed_scale", scale, persistent=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_dim = self.layers[0].head_dim
        self.max_positions = max_positions

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    def build_rope(self, hf_model) -> None:
        """cos/sin for every position, from the model's own rotary module so any
        rope scaling the config declares is applied exactly as transformers does."""
        rotary = hf_model.model.rotary_emb
        positions = torch.arange(self.max_positions)[None, :]
        probe = torch.zeros(1, dtype=torch.float32)
        cos, sin = rotary(probe, positions)
        dtype, device = self.lm_head.weight.dtype, self.lm_head.weight.device
        sin = sin[0].to(dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # what rotate() multiplies by
        self.register_buffer("cos", cos[0].to(dtype).to(device)[:, None, :], persistent=False)
        self.register_buffer("sin", sin.to(device)[:, None, :], persistent=False)

    def forward(self, input_ids, positions, kv: KVCache, meta: AttentionMetadata,
                logits_index: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # fmt: skip
        x, cos, sin = self.embed(input_ids, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, kv, meta, lora)
        return self.logits(x, residual, logits_index)

    def embed(self, input_ids, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (the first layer's input, the rotary cos and sin at positions)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x, self.cos[positions], self.sin[positions]

    def logits(self, x, residual, logits_index: torch.Tensor) -> torch.Tensor:
        """The last layer's output and residual -> float32 logits at logits_index."""
        x, _ = self.norm(x[logits_index], residual[logits_index])
        return self.lm_head(x).to(torch.float32)


@torch.no_grad()
def from_hf(hf_model, max_positions: int, dtype: torch.dtype, device) -> LlamaDecoder:
    cfg = hf_model.config
    model = LlamaDecoder(cfg, max_positions)
    src = dict(hf_model.named_parameters())
    src.update(dict(hf_model.named_buffers()))

    def take(name):
        return src[name].detach()

    model.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
    model.norm.weight.copy_(take("model.norm.weight"))
    if getattr(cfg, "tie_word_embeddings", False) or "lm_head.weight" not in src:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = [take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        layer.qkv_proj.weight.copy_(torch.cat(attn))
        if layer.qkv_proj.bias is not None:
            bias = [take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            layer.qkv_proj.bias.copy_(torch.cat(bias))
        layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
        if layer.o_proj.bias is not None:
            layer.o_proj.bias.copy_(take(p + "self_attn.o_proj.bias"))
        mlp = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        layer.gate_up_proj.weight.copy_(torch.cat(mlp))
        layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
        if layer.gate_up_proj.bias is not None:
            bias = [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]
            layer.gate_up_proj.bias.copy_(torch.cat(bias))
            layer.down_proj.bias.copy_(take(p + "mlp.down_proj.bias"))
        layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
        layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        if layer.qk_norm:
            layer.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
            layer.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
    model = model.to(dtype=dtype, device=device).eval()
    model.build_rope(hf_model)
    return model
