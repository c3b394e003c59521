"""Triton KV write: scatters a step's new K/V rows into the paged cache by slot mapping,
quantizing to fp8 in the same pass when the cache stores fp8.

Layout and scale convention are KVCache's: each layer is [kv_heads, slots, head_dim],
fp8 values are raw bytes (uint8) holding x / scale[head] clamped to the format's range,
rounded to nearest even, bit for bit as torch's float32 -> float8 cast. The rounding is
done with integer ops rather than Triton's float -> fp8 cast: the Triton interpreter's
cast drops the carry when rounding reaches the next power of two (7.87 -> 4.0 instead
of 8.0), and one code path for GPU and interpreter keeps the CPU tests meaningful; the
write is memory-bound, so the extra integer ops should hide behind the loads
(server/bench/gpu.py reports its bandwidth). One program per token
covers every KV head, so a decode step is a single small launch for K and V together.
A negative slot is skipped: padded rows of a captured CUDA graph write nothing.
"""

import torch
import triton
import triton.language as tl

from batchpilot.server.kv.cache import KVCache

# (exponent bias, mantissa bits) of the fp8 formats the cache stores.
FP8_FORMATS = {torch.float8_e4m3fn: (7, 3), torch.float8_e5m2: (15, 2)}


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr, v_scale_ptr,
    new_token_stride, new_head_stride, cache_head_stride, cache_slot_stride,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr,
    FP8: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, DIM_P2)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src = token.to(tl.int64) * new_token_stride + heads[:, None] * new_head_stride + dims[None, :]
    dst = heads[:, None].to(tl.int64) * cache_head_stride + slot * cache_slot_stride + dims[None, :]
    k = tl.load(k_ptr + src, mask=mask)
    v = tl.load(v_ptr + src, mask=mask)
    if FP8:
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
        k = fp8_bytes(k.to(tl.float32) / k_scale[:, None], FP8_BIAS, FP8_MANTISSA, FP8_MAX)
        v = fp8_bytes(v.to(tl.float32) / v_scale[:, None], FP8_BIAS, FP8_MANTISSA, FP8_MAX)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def fp8_bytes(x, BIAS: tl.constexpr, MANTISSA: tl.constexpr, FP8_MAX: tl.constexpr):
    """float32 -> fp8 bits (sign, exponent, mantissa) as uint8, saturating at FP8_MAX."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF  # <= FP8_MAX's bits after the clamp: no int32 overflow below
    # Normal results: drop 23 - MANTISSA mantissa bits rounding to nearest even; a carry
    # runs on into the exponent, then the exponent is rebiased from 127 to BIAS.
    drop = 23 - MANTISSA
    normal = (mag + ((mag >> drop) & 1) + ((1 << (drop - 1)) - 1)) >> drop
    normal -= (127 - BIAS) << MANTISSA
    # Subnormal results count steps of 2**(1 - BIAS - MANTISSA): shift the 24-bit
    # significand right by the exponent gap, same rounding; past 25 bits every value is 0.
    exponent = mag >> 23
    significand = (mag & 0x7FFFFF) | 0x800000
    gap = tl.minimum(151 - BIAS - MANTISSA - exponent, 25)
    sub = (significand + ((significand >> gap) & 1) + ((1 << (gap - 1)) - 1)) >> gap
    out = tl.where(exponent < 128 - BIAS, sub, normal)
    return (out | sign).to(tl.uint8)


def write_kv(kv: KVCache, layer: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:  # fmt: skip
    """k, v: [tokens, kv_heads, head_dim] -> kv's layer at slots (as KVCache.write)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, kv.k_scale[layer], kv.v_scale[layer],
        k.stride(0), k.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads), DIM_P2=triton.next_power_of_2(head_dim),
        FP8=kv.is_fp8, FP8_BIAS=FP8_FORMATS.get(kv.dtype, (0, 0))[0],
        FP8_MANTISSA=FP8_FORMATS.get(kv.dtype, (0, 0))[1], FP8_MAX=float(kv.fp8_max or 0.0),
    )  # fmt: skip
