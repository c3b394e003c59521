"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) running on the paged KV cache:
RMSNorm, RoPE with the model's scaling config, GQA, SwiGLU, tied or untied embeddings.
Weights come from a loaded transformers model; q/k/v and gate/up are fused so each
layer runs four matmuls."""

import torch
from torch import nn

from batchpilot.server.attention import attention
from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers (float32 statistics) so greedy outputs match.
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, index: int):
        super().__init__()
        self.index = index
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        mlp_bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.splits = (q, kv, kv)

    def forward(self, x, cos, sin, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split(self.splits, dim=-1)
        n = x.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = attention(q, k, v, kv, self.index, meta, self.scale)
        x = x + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate).mul_(up))


class LlamaDecoder(nn.Module):
    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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
        self.register_buffer("cos", cos[0].to(dtype).to(device)[:, None, :], persistent=False)
        self.register_buffer("sin", sin[0].to(dtype).to(device)[:, None, :], persistent=False)

    def forward(
        self, input_ids, positions, kv: KVCache, meta: AttentionMetadata, logits_index: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in self.layers:
            x = layer(x, cos, sin, kv, meta)
        x = self.norm(x[logits_index])
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
    model = model.to(dtype=dtype, device=device).eval()
    model.build_rope(hf_model)
    return model
