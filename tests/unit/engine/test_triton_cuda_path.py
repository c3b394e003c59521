"""The pure parts of the CUDA engine path, checked without a GPU: CUDA-graph batch
buckets and the KV budget arithmetic."""

import pytest

from batchpilot.server.model.cuda_graphs import graph_batch_sizes
from batchpilot.server.model.runner import kv_budget_bytes


@pytest.mark.parametrize(
    "max_batch,expected",
    [
        (1, [1]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112]),
    ],
)
def test_graph_batch_sizes_cover_max_batch_with_little_padding(max_batch, expected):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == expected
    assert sizes[-1] >= max_batch and (len(sizes) == 1 or sizes[-2] < max_batch)


def test_kv_budget_takes_peak_and_memory_outside_torch_from_the_utilization_share():
    gib = 1 << 30
    # A 141 GiB device at 0.9: 2 GiB weights plus activations at the warm-up peak, and
    # 0.5 GiB of CUDA context and workspaces outside torch's allocator.
    assert kv_budget_bytes(141 * gib, 0.9, 2 * gib, gib // 2) == int(141 * gib * 0.9) - 5 * gib // 2


def test_kv_budget_is_never_negative():
    assert kv_budget_bytes(16 << 30, 0.1, 15 << 30, 1 << 30) == 0
