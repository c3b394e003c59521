"""LoRASlots, the step-time products: the CPU paths (cpu_lora's kernel, and the masked
dense matmuls where it cannot be built) and the GPU path (the Triton kernels, on CPU
through Triton's interpreter) all add to every row of a fused projection exactly its own
adapter's B(A x), nothing to base-model rows, and an adapter that replaces another in a
slot leaves nothing of it behind; the kernel rounds as the matmuls do in bfloat16."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU

import pytest
import torch

from batchpilot.server.lora import cpu_lora
from batchpilot.server.lora.adapter import LoRAAdapter
from batchpilot.server.lora.slots import FUSED, LoRASlots

SHAPES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
          "gate_proj": (32, 48), "up_proj": (32, 48), "down_proj": (48, 32)}  # fmt: skip
LAYERS, RANK = 2, 8


def random_adapter(name: str, seed: int, rank: int, modules) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(LAYERS):
        for m in modules:
            d_in, d_out = SHAPES[m]
            a = torch.randn(rank, d_in, generator=gen)
            weights[(layer, m)] = (a, torch.randn(d_out, rank, generator=gen))
    return LoRAAdapter(name, f"/adapters/{name}", rank, weights)


def reference(x, adapter: LoRAAdapter | None, layer: int, proj: str) -> torch.Tensor:
    parts = []
    for m in FUSED[proj]:
        pair = None if adapter is None else adapter.weights.get((layer, m))
        d_out = SHAPES[m][1]
        parts.append(torch.zeros(d_out) if pair is None else pair[1] @ (pair[0] @ x))
    return torch.cat(parts)


def make_slots(path: str, num_slots: int, dtype=torch.float32) -> LoRASlots:
    """path: "kernel", "masked" (the kernel taken away) or "triton"."""
    if path == "kernel" and not cpu_lora.usable(dtype, torch.device("cpu")):
        pytest.skip("the CPU LoRA kernel cannot be built here")
    return LoRASlots(LAYERS, SHAPES, num_slots, RANK, dtype, torch.device("cpu"),
                     path == "triton", cpu_kernel=path == "kernel")  # fmt: skip


@pytest.mark.parametrize("path", ["kernel", "masked", "triton"])
def test_each_row_gets_its_own_adapter_product(path):
    slots = make_slots(path, 2)
    every = random_adapter("every", 1, 8, SHAPES)
    qv = random_adapter("qv", 2, 4, ("q_proj", "v_proj"))
    mlp = random_adapter("mlp", 3, 6, ("gate_proj", "down_proj"))
    for rows in ([every, None, qv, qv, None, every], [mlp, qv, None], [None, every, mlp]):
        batch = slots.batch(rows)
        for layer in range(LAYERS):
            for proj, modules in FUSED.items():
                d_in = SHAPES[modules[0]][0]
                d_out = sum(SHAPES[m][1] for m in modules)
                x = torch.randn(len(rows), d_in)
                y = torch.randn(len(rows), d_out)
                want = torch.stack([y[i] + reference(x[i], a, layer, proj)
                                    for i, a in enumerate(rows)])  # fmt: skip
                batch.add(y, x, layer, proj)
                torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    # Three adapters through two slots: "every" was evicted for mlp, then came back.
    assert len(slots.resident) == 2


def test_a_step_without_adapters_has_no_batch():
    slots = LoRASlots(LAYERS, SHAPES, 1, RANK, torch.float32, torch.device("cpu"), False)
    assert slots.batch([None, None]) is None


def test_a_forgotten_adapter_frees_its_slot():
    slots = LoRASlots(LAYERS, SHAPES, 1, RANK, torch.float32, torch.device("cpu"), False)
    first, second = random_adapter("a", 1, 8, SHAPES), random_adapter("b", 2, 8, SHAPES)
    slots.batch([first])
    slots.forget(first)
    assert slots.free == [0] and not slots.resident
    slots.batch([second])
    assert list(slots.resident) == [second.cache_root]


def test_the_kernel_rounds_as_the_bfloat16_matmuls_do():
    """Same roundings as the masked path (h, then the delta, then the sum, each to bf16):
    the two differ at most by the order of float32 sums, one bf16 step at the end."""
    kernel = make_slots("kernel", 2, torch.bfloat16)
    masked = make_slots("masked", 2, torch.bfloat16)
    adapters = [random_adapter("x", 4, 8, SHAPES), random_adapter("y", 5, 3, ("q_proj",))]
    rows = [adapters[0], None, adapters[1], adapters[0]]
    gen = torch.Generator().manual_seed(0)
    for proj, modules in FUSED.items():
        x = torch.randn(len(rows), SHAPES[modules[0]][0], generator=gen).bfloat16()
        y = torch.randn(len(rows), sum(SHAPES[m][1] for m in modules), generator=gen).bfloat16()
        got, want = y.clone(), y.clone()
        kernel.batch(rows).add(got, x, 1, proj)
        masked.batch(rows).add(want, x, 1, proj)
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
        assert torch.equal(got[1], y[1])  # the base-model row is left exactly as it was
