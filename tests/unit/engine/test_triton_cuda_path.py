"""The CUDA engine path as far as it runs without a GPU: CUDA-graph batch buckets, the
static buffers a decode graph replays from (with the capture stood in for by eager
calls, on Triton's interpreter), and the KV budget arithmetic."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined: run on CPU

import pytest
import torch

from batchpilot.server import LLM
from batchpilot.server.attention import build_attention_metadata
from batchpilot.server.kv.cache import KVCache
from batchpilot.server.model.cuda_graphs import DecodeGraphs, graph_batch_sizes
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


class EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay reruns the captured call into
    the same output tensor, reading the same static buffers and metadata."""

    def __init__(self, call, out):
        self.call, self.out = call, out

    def replay(self):
        self.out.copy_(self.call())

    def pool(self):
        return None


def eager_capture(self, size, pool):
    args = (self.input_ids[:size], self.positions[:size], self.kv, self._metadata(size),
            self.logits_index[:size])  # fmt: skip
    out = self.model(*args)
    return EagerGraph(lambda: self.model(*args), out), out


def test_decode_graph_replay_matches_the_eager_step(tiny_model, monkeypatch):
    """Three decodes replayed from the size-4 graph (one padded row) give the eager
    step's logits and K/V writes; capturing and padding write nothing to the cache."""
    monkeypatch.setattr(DecodeGraphs, "_capture", eager_capture)
    model = LLM(tiny_model, dtype="float32", attention_backend="triton", max_model_len=64,
                kv_cache_memory_bytes=1 << 20).engine.runner.model  # fmt: skip
    torch.manual_seed(0)
    kv = KVCache(2, 12, 0, 16, model.num_kv_heads, model.head_dim, torch.float32, "auto",
                 torch.device("cpu"))  # fmt: skip
    kv.k.normal_(), kv.v.normal_()
    eager_kv, before = _clone(kv), _clone(kv)
    seqs = [([7, 2], 20, 1), ([5], 3, 1), ([1, 9, 11], 40, 1)]  # (table, computed, new)
    meta = build_attention_metadata("triton", seqs, 3, 16, torch.float32, model.num_kv_heads,
                                    torch.device("cpu"))  # fmt: skip
    ids, positions = torch.tensor([11, 42, 7]), torch.tensor([20, 3, 40])
    expected = model(ids, positions, eager_kv, meta, torch.arange(3))

    graphs = DecodeGraphs(model, kv, 3, 64, 1, torch.device("cpu"))
    assert graphs.sizes == [1, 2, 4] and torch.equal(kv.k, before.k)
    logits = graphs.replay(ids, positions, meta)
    # A 4-row matmul rounds differently from a 3-row one: 2e-5 on logits of about 5.
    assert torch.allclose(logits, expected, rtol=1e-4, atol=1e-4)
    written = meta.slot_mapping
    untouched = torch.ones(kv.k.shape[2], dtype=torch.bool).index_fill_(0, written, False)
    for cache, eager, old in ((kv.k, eager_kv.k, before.k), (kv.v, eager_kv.v, before.v)):
        assert torch.equal(cache[:, :, untouched], old[:, :, untouched])  # the pad wrote nothing
        assert torch.allclose(cache[:, :, written], eager[:, :, written], atol=1e-5)


def _clone(kv: KVCache) -> KVCache:
    copy = KVCache.__new__(KVCache)
    copy.__dict__.update({k: v.clone() if torch.is_tensor(v) else v for k, v in vars(kv).items()})
    return copy


def test_the_profiling_prefill_runs_on_the_triton_backend(tiny_model, monkeypatch):
    """On CUDA the KV cache is sized by a prefill into a scratch cache before the engine's
    cache exists; on the Triton backend that prefill once raised AttributeError (found on
    the first H200 run). The CPU has no profile step, so this stands in for it: the same
    prefill, at the same point of start-up."""
    from batchpilot.server.model.runner import ModelRunner

    def profiled_budget(runner):
        runner._prefill(list(range(1, 20)), runner._new_kv_cache(2, 0))
        return 1 << 20

    monkeypatch.setattr(ModelRunner, "_kv_budget_bytes", profiled_budget)
    llm = LLM(tiny_model, dtype="float32", attention_backend="triton", max_model_len=64)
    assert llm.engine.runner.kv_cache.num_blocks > 0
