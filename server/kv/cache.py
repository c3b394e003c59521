"""The KV tensors: one flat slot array per layer (slot = block * block_size + offset),
optional FP8 storage with per-layer, per-KV-head scales, and block copies to and from
the CPU swap space."""

import torch

FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# Calibrated amax is stretched by this much so unseen activations rarely clip.
FP8_SCALE_HEADROOM = 2.0


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_DTYPES.get(kv_cache_dtype, model_dtype)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_cpu_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                 kv_cache_dtype: str, device: torch.device):
        self.block_size = block_size
        self.model_dtype = model_dtype
        self.dtype = storage_dtype(kv_cache_dtype, model_dtype)
        self.is_fp8 = kv_cache_dtype in FP8_DTYPES
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)
        cpu_shape = (num_layers, num_cpu_blocks * block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        # Left uninitialised so unused swap space costs no resident memory; swap-out
        # copies whole blocks, so swap-in never reads a byte it did not write.
        self.cpu_k = torch.empty(cpu_shape, dtype=self.dtype, pin_memory=pin)
        self.cpu_v = torch.empty(cpu_shape, dtype=self.dtype, pin_memory=pin)
        scale_shape = (num_layers, num_kv_heads, 1)
        self.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        self.fp8_max = torch.finfo(self.dtype).max if self.is_fp8 else None
        self.calibrating = False
        self._k_amax = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self._v_amax = torch.zeros(scale_shape, dtype=torch.float32, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] -> the cache at slot positions."""
        if self.is_fp8:
            if self.calibrating:
                self._observe(layer, k, v)
            k = self._quantize(k, self.k_scale[layer])
            v = self._quantize(v, self.v_scale[layer])
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: any shape S -> k, v of shape S + [kv_heads, head_dim] in the model dtype."""
        k, v = self.k[layer][slots], self.v[layer][slots]
        if self.is_fp8:
            k = (k.to(torch.float32) * self.k_scale[layer]).to(self.model_dtype)
            v = (v.to(torch.float32) * self.v_scale[layer]).to(self.model_dtype)
        return k, v

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32) / scale
        return x.clamp(-self.fp8_max, self.fp8_max).to(self.dtype)

    def _observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_amax = k.detach().abs().to(torch.float32).amax(dim=(0, 2)).unsqueeze(-1)
        v_amax = v.detach().abs().to(torch.float32).amax(dim=(0, 2)).unsqueeze(-1)
        torch.maximum(self._k_amax[layer], k_amax, out=self._k_amax[layer])
        torch.maximum(self._v_amax[layer], v_amax, out=self._v_amax[layer])

    def finish_calibration(self) -> None:
        """Scales from the amax seen while calibrating, per layer and KV head."""
        self.calibrating = False
        floor = torch.finfo(torch.float32).tiny
        self.k_scale = (self._k_amax * FP8_SCALE_HEADROOM / self.fp8_max).clamp_min(floor)
        self.v_scale = (self._v_amax * FP8_SCALE_HEADROOM / self.fp8_max).clamp_min(floor)

    def _slots(self, blocks: list[int], device) -> torch.Tensor:
        base = torch.tensor(blocks, dtype=torch.long, device=device) * self.block_size
        return (base[:, None] + torch.arange(self.block_size, device=device)).flatten()

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: device -> CPU swap space."""
        if not mapping:
            return
        src = self._slots([g for g, _ in mapping], self.k.device)
        dst = self._slots([c for _, c in mapping], "cpu")
        self.cpu_k[:, dst] = self.k[:, src].cpu()
        self.cpu_v[:, dst] = self.v[:, src].cpu()

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: CPU swap space -> device."""
        if not mapping:
            return
        src = self._slots([c for c, _ in mapping], "cpu")
        dst = self._slots([g for _, g in mapping], self.k.device)
        self.k[:, dst] = self.cpu_k[:, src].to(self.k.device, non_blocking=True)
        self.v[:, dst] = self.cpu_v[:, src].to(self.v.device, non_blocking=True)
