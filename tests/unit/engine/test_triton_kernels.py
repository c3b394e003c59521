"""The Triton kernels against the torch reference, on CPU through Triton's interpreter.

Each case is one step on a small paged cache: random K/V everywhere (never zeros),
scattered block tables, context lengths on and off block boundaries. Slots outside
every context are poisoned with NaN in the cache the kernels read, and the output is
NaN-filled before each run, so a read past a context or a row left unwritten shows.

fp8: the interpreter's float -> fp8 cast loses the carry at power-of-two boundaries,
which is why the write kernel rounds with integer ops; test_fp8_bytes checks those bit
for bit against torch. Widening fp8 -> float is exact in the interpreter and is used as
is. For fp8 steps the new K/V are drawn on the fp8 grid of the cache's scales, so the
reference (which reads a chunk's own tokens back from the fp8 cache) and the extend
kernel (which reads them unquantized) see the same values and can be held to the same
tolerance as an unquantized cache.

Triton must be importable here: a missing triton fails this module instead of skipping.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU

import pytest
import torch
import triton
import triton.language as tl

from batchpilot.server.attention.metadata import build_metadata
from batchpilot.server.attention.paged import paged_attention
from batchpilot.server.attention.triton_attention import triton_paged_attention
from batchpilot.server.attention.triton_decode import decode_attention
from batchpilot.server.attention.triton_extend import extend_attention
from batchpilot.server.attention.triton_kv_write import FP8_FORMATS, fp8_bytes, write_kv
from batchpilot.server.attention.triton_metadata import build_triton_metadata
from batchpilot.server.kv.cache import KVCache

CPU = torch.device("cpu")
# ||out - ref|| / ||ref|| bounds. Measured worst: float32 2e-7 (rounding order alone);
# bf16 5e-3, one bf16 rounding of the output plus the reference's own bf16 matmuls.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
CASES = [  # (model dtype, kv_cache_dtype)
    (torch.float32, "auto"),
    (torch.bfloat16, "auto"),
    (torch.float32, "fp8"),
    (torch.bfloat16, "fp8_e4m3"),
    (torch.bfloat16, "fp8_e5m2"),
]
IDS = [f"{str(d).removeprefix('torch.')}-{kv}" for d, kv in CASES]
LAYER = 1


class Step:
    """One step: decodes (one token each, context lengths given) then prefill chunks
    (cached prefix, new tokens), with the reference cache and a poisoned copy."""

    def __init__(self, dtype, kv_dtype, decodes=(), chunks=(), heads=6, kv_heads=2, dim=32,
                 block_size=4, seed=0):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.scale = dtype, dim**-0.5
        contexts = list(decodes) + [p + n for p, n in chunks]
        used = [-(-c // block_size) for c in contexts]
        num_blocks = sum(used) + 3  # a few blocks no sequence owns
        self.ref = KVCache(2, num_blocks, 0, block_size, kv_heads, dim, dtype, kv_dtype, CPU)
        _fill_random(self.ref, gen)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [order[sum(used[:i]) : sum(used[: i + 1])] for i in range(len(used))]
        self.seqs = [(t, c - 1, 1) for t, c in zip(tables, decodes, strict=False)]
        self.seqs += [(t, p, n) for t, (p, n) in zip(tables[len(decodes) :], chunks, strict=True)]
        self.num_decodes = len(decodes)
        tokens = len(decodes) + sum(n for _, n in chunks)
        randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        self.q = randn(tokens, heads, dim).to(dtype)
        self.k = self._on_fp8_grid(randn(tokens, kv_heads, dim) * 2, self.ref.k_scale[LAYER])
        self.v = self._on_fp8_grid(randn(tokens, kv_heads, dim), self.ref.v_scale[LAYER])
        self.kv = _clone(self.ref)
        self._poison_unused_slots(tables, contexts)

    def _on_fp8_grid(self, x, scale):
        if self.ref.is_fp8:
            x = (x.transpose(0, 1) / scale).to(self.ref.dtype).float().mul(scale).transpose(0, 1)
        return x.to(self.dtype)

    def _poison_unused_slots(self, tables, contexts):
        """NaN (0x7f in both fp8 formats) in every slot outside every context."""
        bs = self.kv.block_size
        unused = torch.ones(self.kv.num_blocks * bs, dtype=torch.bool)
        for table, n in zip(tables, contexts, strict=True):
            unused[[table[p // bs] * bs + p % bs for p in range(n)]] = False
        nan = 0x7F if self.kv.is_fp8 else float("nan")
        self.kv.k[:, :, unused] = nan
        self.kv.v[:, :, unused] = nan

    def reference(self) -> torch.Tensor:
        meta = build_metadata(self.seqs, self.num_decodes, self.ref.block_size, self.dtype, CPU)
        return paged_attention(self.q, self.k, self.v, self.ref, LAYER, meta, self.scale)

    def poisoned_out(self) -> torch.Tensor:
        return torch.full((self.q.shape[0], self.q.shape[1] * self.q.shape[2]), float("nan"),
                          dtype=self.dtype)  # fmt: skip

    def write(self) -> None:
        slots = build_triton_metadata(self.seqs, self.num_decodes, self.kv.block_size,
                                      2, 1, CPU).slot_mapping  # fmt: skip
        write_kv(self.kv, LAYER, slots, self.k, self.v)


def _fill_random(kv: KVCache, gen: torch.Generator) -> None:
    for cache in (kv.k, kv.v):
        x = torch.randn(cache.shape, generator=gen)
        cache.copy_(x.to(kv.dtype).view(kv.raw_dtype) if kv.is_fp8 else x.to(kv.dtype))
    if kv.is_fp8:  # per-head scales two orders of magnitude apart
        kv.k_scale = torch.rand(kv.k_scale.shape, generator=gen) * 0.2 + 0.002
        kv.v_scale = torch.rand(kv.v_scale.shape, generator=gen) * 0.2 + 0.002


def _clone(kv: KVCache) -> KVCache:
    copy = KVCache.__new__(KVCache)
    copy.__dict__.update({k: v.clone() if torch.is_tensor(v) else v for k, v in vars(kv).items()})
    return copy


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_same_cache(a: KVCache, b: KVCache, step: Step) -> None:
    bs = a.block_size
    slots = [t[p // bs] * bs + p % bs for t, s, n in step.seqs for p in range(s, s + n)]
    for x, y in ((a.k, b.k), (a.v, b.v)):
        assert torch.equal(x[LAYER][:, slots], y[LAYER][:, slots])


@pytest.mark.parametrize("dtype,kv_dtype", CASES, ids=IDS)
def test_kv_write_matches_cache_write(dtype, kv_dtype):
    step = Step(dtype, kv_dtype, decodes=[5, 8], chunks=[(0, 7), (9, 6)], seed=1)
    # Off the fp8 grid: the kernel's rounding itself is under test here.
    k = torch.randn(step.k.shape).mul(3).to(dtype)
    v = torch.randn(step.v.shape).to(dtype)
    step.k, step.v = k, v
    slots = build_triton_metadata(step.seqs, step.num_decodes, 4, 2, 1, CPU).slot_mapping
    step.ref.write(LAYER, slots, k, v)
    step.write()
    assert_same_cache(step.ref, step.kv, step)


def test_kv_write_skips_negative_slots():
    step = Step(torch.float32, "fp8", decodes=[3, 6], seed=2)
    before = step.kv.k.clone()
    write_kv(step.kv, LAYER, torch.tensor([-1, -1]), step.k, step.v)
    assert torch.equal(step.kv.k.view(torch.uint8), before.view(torch.uint8))


@triton.jit
def _fp8_bytes_kernel(x_ptr, out_ptr, BIAS: tl.constexpr, MANTISSA: tl.constexpr,
                      FP8_MAX: tl.constexpr, N: tl.constexpr):  # fmt: skip
    offsets = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + offsets, fp8_bytes(tl.load(x_ptr + offsets), BIAS, MANTISSA, FP8_MAX))


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
def test_fp8_bytes(fp8):
    """Every finite fp8 value, the midpoints between neighbours (ties to even) and one
    float32 step either side of them, subnormals, signed zeros, values past the range."""
    bias, mantissa = FP8_FORMATS[fp8]
    fp8_max = torch.finfo(fp8).max
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[grid.isfinite()].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([
        grid, mid, mid.nextafter(torch.tensor(1e9)), mid.nextafter(torch.tensor(-1e9)),
        torch.randn(1000) * fp8_max / 8, torch.randn(1000) * 1e-3,
        torch.tensor([2 * fp8_max, -3 * fp8_max, 1e-30, -1e-40, 0.0, -0.0]),
    ])  # fmt: skip
    x = torch.cat([x, torch.ones(-len(x) % 256)])
    out = torch.empty(len(x), dtype=torch.uint8)
    _fp8_bytes_kernel[(len(x) // 256,)](x, out, bias, mantissa, fp8_max, 256)
    assert torch.equal(out, x.clamp(-fp8_max, fp8_max).to(fp8).view(torch.uint8))


@pytest.mark.parametrize(
    "dtype,kv_dtype,num_splits",
    [(d, kv, 1) for d, kv in CASES] + [(torch.float32, "fp8", 4), (torch.bfloat16, "auto", 4)],
    ids=[f"{i}-1split" for i in IDS] + ["float32-fp8-4splits", "bfloat16-auto-4splits"],
)
def test_decode_matches_reference(dtype, kv_dtype, num_splits):
    # Contexts at, just under and just over block (4) and loop tile (16) boundaries; with
    # 4 splits of 12 tokens, splits start off tile boundaries and short contexts leave
    # splits empty.
    contexts = [1, 3, 4, 5, 16, 17, 31, 47]
    step = Step(dtype, kv_dtype, decodes=contexts, seed=3)
    ref = step.reference()
    step.write()
    meta = build_triton_metadata(step.seqs, step.num_decodes, 4, 2, 1, CPU)
    out = step.poisoned_out()
    decode_attention(step.q, step.kv, LAYER, meta.decode_tables, meta.context_lens, step.scale,
                     out, -(-max(contexts) // num_splits), num_splits, block_n=16)  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert_same_cache(step.ref, step.kv, step)


@pytest.mark.parametrize("dtype,kv_dtype", CASES, ids=IDS)
def test_extend_matches_reference(dtype, kv_dtype):
    # Fresh prompts of 1, 7 and 19 tokens; chunks behind cached prefixes that end on and
    # off block boundaries; queries span several 16-row tiles.
    chunks = [(0, 1), (0, 7), (0, 19), (4, 5), (13, 18), (1, 1)]
    step = Step(dtype, kv_dtype, chunks=chunks, heads=4, seed=4)
    ref = step.reference()
    step.write()
    meta = build_triton_metadata(step.seqs, 0, 4, 2, 1, CPU)
    out = step.poisoned_out()
    extend_attention(step.q, step.k, step.v, step.kv, LAYER, meta.chunk_rows, meta.chunk_lens,
                     meta.prefix_lens, meta.chunk_tables, meta.max_chunk_len, step.scale, out,
                     block_m=16, block_n=16)  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[dtype]


SHAPES = [(6, 2, 32), (4, 4, 16), (8, 1, 24), (6, 2, 32), (8, 1, 24)]  # heads, kv_heads, dim


@pytest.mark.parametrize(
    "dtype,kv_dtype,heads,kv_heads,dim",
    [case + shape for case, shape in zip(CASES, SHAPES, strict=True)],
    ids=[f"{i}-{h}x{kvh}x{d}" for i, (h, kvh, d) in zip(IDS, SHAPES, strict=True)],
)
def test_mixed_step_matches_reference(dtype, kv_dtype, heads, kv_heads, dim):
    """A whole layer call with default tiles: write, decodes and chunks in one step."""
    step = Step(dtype, kv_dtype, decodes=[2, 9, 12], chunks=[(0, 11), (8, 3)], heads=heads,
                kv_heads=kv_heads, dim=dim, seed=5)  # fmt: skip
    ref = step.reference()
    meta = build_triton_metadata(step.seqs, step.num_decodes, 4, kv_heads, 1, CPU)
    out = triton_paged_attention(step.q, step.k, step.v, step.kv, LAYER, meta, step.scale,
                                 out=step.poisoned_out())  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert_same_cache(step.ref, step.kv, step)


def test_long_decode_splits_by_sm_count():
    """The metadata's own split choice: 600-token contexts on a many-SM device split."""
    step = Step(torch.float32, "auto", decodes=[600, 513], block_size=16, dim=16, seed=6)
    ref = step.reference()
    meta = build_triton_metadata(step.seqs, 2, 16, 2, 132, CPU)
    assert meta.num_splits == 2
    out = triton_paged_attention(step.q, step.k, step.v, step.kv, LAYER, meta, step.scale,
                                 out=step.poisoned_out())  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
