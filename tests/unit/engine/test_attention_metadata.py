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


def test_the_cpu_kernel_gets_every_decode_in_one_bucket_without_a_mask():
    import torch

    from batchpilot.server.attention.metadata import build_metadata

    seqs = [([3], 15, 1), ([4, 5], 17, 1), ([6] * 40, 600, 1), ([7, 8], 0, 20)]
    cpu = torch.device("cpu")
    kernel = build_metadata(seqs, 3, 16, torch.float32, cpu, cpu_kernel=True)
    [bucket] = kernel.decode_buckets
    assert (bucket.start, bucket.end, bucket.mask) == (0, 3, None)
    assert bucket.context_lens.tolist() == [16, 18, 601]
    assert bucket.blocks.shape == (3, 38) and bucket.blocks[1, :2].tolist() == [4, 5]
    torch_path = build_metadata(seqs, 3, 16, torch.float32, cpu)
    assert len(torch_path.decode_buckets) == 1  # too few sequences for a second call
    assert torch_path.decode_buckets[0].mask.shape == (1, 3, 1, 38 * 16)
    assert build_metadata(seqs[3:], 0, 16, torch.float32, cpu, True).decode_buckets == []
