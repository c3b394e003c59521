"""The KV tensors, laid out per layer as [kv_heads, slots, head_dim] where
slot = block * block_size + offset. Head-major blocks are contiguous runs, so one
index_select over block ids gathers a batch's whole context per head. Optional FP8
storage with per-layer, per-KV-head scales; block copies to and from pinned CPU swap space
that do not block the host on CUDA."""

import math
import mmap

import torch

FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# Calibrated amax is stretched so unseen outliers (attention-sink tokens) do not clip;
# e4m3 keeps its relative precision down to amax * 32 / 448 * 2**-6, so little is lost.
FP8_SCALE_HEADROOM = 32.0


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_DTYPES.get(kv_cache_dtype, model_dtype)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:  # fmt: skip
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU, over an anonymous mapping: the kernel hands out its pages
    zeroed as they are first written, where torch.zeros writes all of them before the
    server is Ready (1 GiB: 0.5 s quiet, 2 s on a busy node) and makes them resident at
    once. The tensor keeps the mapping alive."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_cpu_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                 kv_cache_dtype: str, device: torch.device):  # fmt: skip
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.model_dtype = model_dtype
        self.dtype = storage_dtype(kv_cache_dtype, model_dtype)
        self.is_fp8 = kv_cache_dtype in FP8_DTYPES
        # FP8 values are kept as raw bytes: CPU index_copy_/index_select lack float8 kernels.
        self.raw_dtype = torch.uint8 if self.is_fp8 else self.dtype
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k = zeroed(shape, self.raw_dtype, device)
        self.v = zeroed(shape, self.raw_dtype, device)
        # Block-major, so a swapped block is one contiguous run: one non-blocking copy
        # each way between the device and pinned memory.
        cpu_shape = (num_cpu_blocks, num_layers, num_kv_heads, block_size, head_dim)
        pin = device.type == "cuda"
        # Left uninitialised so unused swap space costs no resident memory; swap-out
        # copies whole blocks, so swap-in never reads a byte it did not write.
        self.cpu_k = torch.empty(cpu_shape, dtype=self.raw_dtype, pin_memory=pin)
        self.cpu_v = torch.empty(cpu_shape, dtype=self.raw_dtype, pin_memory=pin)
        scale_shape = (num_layers, num_kv_heads, 1, 1)
        self.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        self.fp8_max = torch.finfo(self.dtype).max if self.is_fp8 else None
        self.calibrating = False
        self._k_amax = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self._v_amax = torch.zeros(scale_shape, dtype=torch.float32, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] -> the cache at slot positions."""
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.is_fp8:
            if self.calibrating:
                self._observe(layer, k, v)
            k = self._quantize(k, self.k_scale[layer])
            v = self._quantize(v, self.v_scale[layer])
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks: [seqs, max_blocks] -> k, v: [kv_heads, seqs, max_blocks * block_size, dim]
        in the model dtype."""
        seqs, width = blocks.shape
        flat = blocks.flatten()
        out = []
        for cache, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            heads, _, dim = cache[layer].shape
            paged = cache[layer].view(heads, self.num_blocks, self.block_size, dim)
            x = paged.index_select(1, flat).view(heads, seqs, width * self.block_size, dim)
            if self.is_fp8:
                x = x.view(self.dtype).to(torch.float32) * scale[layer].unsqueeze(1)
                x = x.to(self.model_dtype)
            out.append(x)
        return out[0], out[1]

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32) / scale
        return x.clamp(-self.fp8_max, self.fp8_max).to(self.dtype).view(torch.uint8)

    def _observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for x, amax in ((k, self._k_amax), (v, self._v_amax)):
            seen = x.detach().abs().to(torch.float32).amax(dim=(1, 2)).view(-1, 1, 1)
            torch.maximum(amax[layer], seen, out=amax[layer])

    def finish_calibration(self) -> None:
        """Scales from the amax seen while calibrating, per layer and KV head."""
        self.calibrating = False
        floor = torch.finfo(torch.float32).tiny
        self.k_scale = (self._k_amax * FP8_SCALE_HEADROOM / self.fp8_max).clamp_min(floor)
        self.v_scale = (self._v_amax * FP8_SCALE_HEADROOM / self.fp8_max).clamp_min(floor)

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        layers, heads, slots, dim = cache.shape
        return cache.view(layers, heads, slots // self.block_size, self.block_size, dim)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: device -> CPU swap space. On CUDA this only
        queues work on the current stream: the blocks are gathered before the next
        kernel can reuse them, and a later swap-in, on the same stream, is the only
        reader of the pinned copies, so nothing waits for the transfer."""
        if not mapping:
            return
        src = torch.tensor([g for g, _ in mapping], device=self.k.device)
        for cache, cpu in ((self.k, self.cpu_k), (self.v, self.cpu_v)):
            gathered = self._blocks(cache)[:, :, src].permute(2, 0, 1, 3, 4).contiguous()
            for i, (_, c) in enumerate(mapping):
                cpu[c].copy_(gathered[i], non_blocking=True)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs: CPU swap space -> device, queued like swap_out."""
        if not mapping:
            return
        dst = torch.tensor([g for _, g in mapping], device=self.k.device)
        for cache, cpu in ((self.k, self.cpu_k), (self.v, self.cpu_v)):
            staged = torch.empty((len(mapping), *cpu.shape[1:]), dtype=cpu.dtype,
                                 device=cache.device)  # fmt: skip
            for i, (c, _) in enumerate(mapping):
                staged[i].copy_(cpu[c], non_blocking=True)
            self._blocks(cache)[:, :, dst] = staged.permute(1, 2, 0, 3, 4)
