"""CUDA graphs for decode-only steps (`cuda_graphs`, CUDA with Triton attention; off by
default).

A decode step of a small model is bound by launching a few hundred kernels from Python,
not by the GPU. Capturing the model's forward once per bucketed batch size and replaying
it removes that cost. A step is replayed when every sequence in it decodes one token and
their number fits a captured size; rows past the batch are padding (slot -1, which the
KV write skips; context 1; logits dropped).

What keeps a captured forward valid: every input is a static buffer refilled in place;
the KV cache and its fp8 scales are not reallocated after capture (graphs are captured
after fp8 calibration); the decode grid is fixed per size by splitting max_model_len
rather than the step's longest context, since splits past a sequence's context exit at
once. Padded rows keep stale block ids and tokens, which are valid indices.
"""

import torch

from batchpilot.server.attention.triton_metadata import (
    TritonMetadata,
    num_splits_for,
    tokens_per_split,
)
from batchpilot.server.kv.cache import KVCache


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first size that holds max_batch."""
    sizes = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    return sizes[: next(i for i, s in enumerate(sizes) if s >= max_batch) + 1]


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, max_batch: int, max_model_len: int, num_sms: int,
                 device: torch.device):  # fmt: skip
        self.model, self.kv = model, kv
        self.sizes = graph_batch_sizes(max_batch)
        self.max_model_len, self.num_sms = max_model_len, num_sms
        n, width = self.sizes[-1], -(-max_model_len // kv.block_size)
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids, self.positions = zeros(n), zeros(n)
        self.slots = zeros(n).fill_(-1)
        self.tables = zeros(n, width, dtype=torch.int32)
        self.context_lens = zeros(n, dtype=torch.int32).fill_(1)
        self.logits_index = torch.arange(n, device=device)
        self.empty = zeros(0, dtype=torch.int32)
        self.graphs, self.logits, pool = {}, {}, None
        for size in reversed(self.sizes):  # largest first: the others reuse its memory pool
            self.graphs[size], self.logits[size] = self._capture(size, pool)
            pool = self.graphs[size].pool()

    def _metadata(self, size: int) -> TritonMetadata:
        splits = num_splits_for(size, self.kv.k.shape[1], self.max_model_len, self.num_sms)
        return TritonMetadata(
            self.slots[:size], size, self.tables[:size], self.context_lens[:size], splits,
            tokens_per_split(self.max_model_len, splits), self.empty, self.empty, self.empty,
            self.empty, 0,
        )  # fmt: skip

    @torch.inference_mode()
    def _capture(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.input_ids[:size], self.positions[:size], self.kv, self._metadata(size),
                self.logits_index[:size])  # fmt: skip
        self.model(*args)  # compiles the kernels and warms the allocator outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model(*args)
        return graph, logits

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: TritonMetadata) -> torch.Tensor:  # fmt: skip
        """A decode-only step's inputs and metadata -> its logits (a view of the graph's
        output, valid until the next replay)."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        # Columns past this step's widest table keep stale ids: no context reaches them.
        self.tables[:n, : meta.decode_tables.shape[1]].copy_(meta.decode_tables)
        self.context_lens[:n].copy_(meta.context_lens)
        self.slots[n:size].fill_(-1)
        self.context_lens[n:size].fill_(1)
        self.graphs[size].replay()
        return self.logits[size][:n]
