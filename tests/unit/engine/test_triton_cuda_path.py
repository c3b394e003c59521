"""The pure parts of the CUDA engine path, checked without a GPU."""

import pytest

from batchpilot.server.model.cuda_graphs import graph_batch_sizes


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
