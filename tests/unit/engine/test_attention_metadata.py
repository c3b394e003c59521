import itertools

from batchpilot.server.attention.metadata import _buckets


def test_decodes_bucket_by_context_length():
    ctx = [16] * 4 + [40] * 3 + [300] * 5
    assert _buckets(ctx, 16) == [(0, 4), (4, 8), (8, 12)]
    # Too few sequences to be worth a second call: one bucket.
    assert _buckets([10, 20, 500], 16) == [(0, 3)]
    assert _buckets([], 16) == []
    ranges = _buckets(sorted([3, 17, 33, 65, 129, 257, 513, 1025] * 4), 16)
    assert ranges[0][0] == 0 and ranges[-1][1] == 32
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert len(ranges) > 2
