"""The multi-LoRA Triton kernels against a per-row torch.einsum reference, on CPU through
Triton's interpreter. Slots mix -1 (no adapter) with repeated adapters; sizes are off the
kernels' block sizes so every mask is exercised; y is written through a strided view and
h read from a column slice, as the model's fused projections will pass them."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU

import pytest
import torch

from batchpilot.server.lora.triton_lora import lora_expand, lora_shrink

NUM_SLOTS = 3
# (atol, rtol). Only the float32 summation order differs from the reference, for both
# dtypes (bfloat16 widens exactly). Shrink sums up to 960 unit-variance products (values
# around 30), so its absolute bound is looser; expand's one rounding of y to bfloat16
# may land one ulp (2**-8 relative) apart.
SHRINK_TOLERANCE = (1e-4, 1e-5)
EXPAND_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1.6e-2)}
CASES = [  # (dtype, n, rank, d)
    (torch.float32, 37, 16, 576),
    (torch.float32, 1, 8, 33),
    (torch.float32, 37, 12, 960),
    (torch.bfloat16, 37, 12, 576),
    (torch.bfloat16, 5, 16, 33),
    (torch.float32, 6, 80, 100),  # rank > 64: shrink splits ranks over two programs
]
IDS = [f"{str(c[0]).removeprefix('torch.')}-n{c[1]}-r{c[2]}-d{c[3]}" for c in CASES]


def make_slots(n: int, gen: torch.Generator, dtype=torch.int32) -> torch.Tensor:
    """Random slots in [-1, NUM_SLOTS): with n > 4, at least one -1 and a repeated adapter."""
    slots = torch.randint(-1, NUM_SLOTS, (n,), generator=gen)
    if n > 4:
        slots[:4] = torch.tensor([-1, 1, 1, 0])
    elif n == 1:
        slots[0] = NUM_SLOTS - 1  # the last slot: an off-by-one slot stride shows
    return slots.to(dtype)


def shrink_reference(x, a, slots):
    h = torch.einsum("nrd,nd->nr", a[slots.clamp(min=0).long()].float(), x.float())
    return torch.where((slots >= 0)[:, None], h, 0.0)


@pytest.mark.parametrize(("dtype", "n", "rank", "d_in"), CASES, ids=IDS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_shrink(dtype, n, rank, d_in, slot_dtype):
    gen = torch.Generator().manual_seed(n * rank + d_in)
    wide = torch.randn(n, d_in + 7, generator=gen).to(dtype)
    x = wide[:, 5 : 5 + d_in]  # a row-strided x
    a = torch.randn(NUM_SLOTS, rank, d_in, generator=gen).to(dtype)
    slots = make_slots(n, gen, slot_dtype)
    h = lora_shrink(x, a, slots)
    assert h.dtype == torch.float32 and h.shape == (n, rank)
    atol, rtol = SHRINK_TOLERANCE
    torch.testing.assert_close(h, shrink_reference(x, a, slots), atol=atol, rtol=rtol)
    assert torch.equal(h[slots < 0], torch.zeros_like(h[slots < 0]))


@pytest.mark.parametrize(("dtype", "n", "rank", "d_out"), CASES, ids=IDS)
def test_expand(dtype, n, rank, d_out):
    gen = torch.Generator().manual_seed(n * rank + d_out + 1)
    offset, d_total = 3, d_out + 10
    big = torch.randn(n, d_total + 200, generator=gen).to(dtype)
    y = big[:, 100 : 100 + d_total]  # row stride d_total + 200, as a fused projection's slice
    wide = torch.randn(n, 3 * rank, generator=gen)
    h = wide[:, rank : 2 * rank]  # a column slice of a wider float32 tensor
    b = torch.randn(NUM_SLOTS, d_out, rank, generator=gen).to(dtype)
    slots = make_slots(n, gen)
    expected = big.clone()
    active = slots >= 0
    delta = torch.einsum("nor,nr->no", b[slots.clamp(min=0).long()].float(), h)
    window = expected[:, 100 + offset : 100 + offset + d_out]
    window[active] = (window[active].float() + delta[active]).to(dtype)
    before = big.clone()

    lora_expand(y, h, b, slots, offset=offset)

    atol, rtol = EXPAND_TOLERANCE[dtype]
    torch.testing.assert_close(big, expected, atol=atol, rtol=rtol)
    # Everything outside the active rows' window is untouched, bit for bit.
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[active, 100 + offset : 100 + offset + d_out] = False
    assert torch.equal(big[untouched], before[untouched])


def test_shrink_then_expand():
    """Both launches together equal y + B (A x) per row: what a LoRA layer computes."""
    gen = torch.Generator().manual_seed(7)
    n, rank, d_in, d_out = 9, 8, 48, 40
    x = torch.randn(n, d_in, generator=gen)
    a = torch.randn(NUM_SLOTS, rank, d_in, generator=gen)
    b = torch.randn(NUM_SLOTS, d_out, rank, generator=gen)
    y = torch.randn(n, d_out, generator=gen)
    slots = make_slots(n, gen, torch.int64)
    expected = y.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[i] += b[slot] @ (a[slot] @ x[i])
    lora_expand(y, lora_shrink(x, a, slots), b, slots)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_empty_batch():
    a = torch.randn(NUM_SLOTS, 8, 16)
    slots = torch.empty(0, dtype=torch.int32)
    h = lora_shrink(torch.empty(0, 16), a, slots)
    assert h.shape == (0, 8)
    lora_expand(torch.empty(0, 24), h, torch.randn(NUM_SLOTS, 24, 8), slots)
