"""The CPU decode kernel that reads K/V blocks in place, against the torch path (gather
the blocks, masked matmuls, softmax) on scrambled block tables and uneven contexts."""

from types import SimpleNamespace

import pytest
import torch

from batchpilot.server.attention import cpu_decode, cpu_decode_choice
from batchpilot.server.attention.paged import _decode_attention

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="no C++ toolchain here")

KV_HEADS, GROUP, DIM, BLOCK, NUM_BLOCKS = 2, 3, 16, 4, 64


def torch_reference(q, k_cache, v_cache, tables, lens, scale):
    n, width = tables.shape
    gather = lambda c: c.view(KV_HEADS, NUM_BLOCKS, BLOCK, DIM).index_select(1, tables.flatten())  # noqa: E731
    k = gather(k_cache).view(KV_HEADS, n, width * BLOCK, DIM)
    v = gather(v_cache).view(KV_HEADS, n, width * BLOCK, DIM)
    allowed = torch.arange(width * BLOCK)[None, :] < lens[:, None]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    qd = q.view(n, KV_HEADS, GROUP, DIM).transpose(0, 1)
    o = _decode_attention(qd, k, v, mask[None, :, None, :], scale)
    return o.transpose(0, 1).reshape(n, KV_HEADS * GROUP * DIM)


# float16 keeps enough mantissa to catch an error in the kernel's own exp, which the
# 16-bit types use (float32 keeps libm's, in double).
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)]
)
def test_kernel_matches_the_gathering_torch_path(dtype, atol):
    torch.manual_seed(0)
    k_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, dtype=dtype)
    v_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, dtype=dtype)
    lens = torch.tensor([1, 3, 4, 5, 17, 30])  # within a block, at its edge, across several
    width = -(-int(lens.max()) // BLOCK)
    tables = torch.randperm(NUM_BLOCKS)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), KV_HEADS * GROUP, DIM, dtype=dtype)
    got = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, BLOCK, DIM**-0.5)
    want = torch_reference(q, k_cache, v_cache, tables, lens, DIM**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def exact_attention(q, k_cache, v_cache, tables, lens, block, scale) -> torch.Tensor:
    """Each sequence's attention in float64 over the positions its block table names."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for s in range(n):
        slots = torch.tensor([int(tables[s, t // block]) * block + t % block
                              for t in range(int(lens[s]))])  # fmt: skip
        for h in range(heads):
            kv = h // (heads // kv_heads)
            k, v = k_cache[kv, slots].double(), v_cache[kv, slots].double()
            weights = torch.softmax(k @ q[s, h].double() * scale, dim=0)
            out[s, h] = weights @ v
    return out.view(n, heads * dim)


# bf16 at these head_dims and groups takes the AVX-512 register-blocked job where the
# build has AVX-512, the portable loop elsewhere: both must give the exact attention.
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bf16_decode_at_real_head_dims_is_the_exact_attention(dim, group):
    torch.manual_seed(dim + group)
    kv_heads, block, blocks = 2, 16, 40
    k_cache = torch.randn(kv_heads, blocks * block, dim).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, blocks * block, dim).to(torch.bfloat16)
    lens = torch.tensor([1, 16, 17, 150, 300])
    tables = torch.stack([torch.randperm(blocks)[:19] for _ in lens])
    q = torch.randn(len(lens), kv_heads * group, dim).to(torch.bfloat16)
    got = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, block, dim**-0.5)
    want = exact_attention(q, k_cache, v_cache, tables, lens, block, dim**-0.5)
    # One bf16 rounding of the output (2^-8 relative) and float32 sums before it.
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2**-7)


def test_a_failed_build_leaves_the_torch_path(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    assert cpu_decode.load.__wrapped__() is None


# ---- kernel or torch: the verdict ---------------------------------------------------------

SHAPES = dict(num_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    """Verdicts in tmp_path, and a timing that returns what the test sets with
    `fake(kernel_ms, torch_ms)` and counts its calls."""
    timing = SimpleNamespace(calls=[], ms=(2.0, 1.0), dir=tmp_path)
    timing.fake = lambda kernel_ms, torch_ms: setattr(timing, "ms", (kernel_ms, torch_ms))

    def time_both(*shapes):
        timing.calls.append(shapes)
        return timing.ms

    monkeypatch.setattr(cpu_decode_choice, "verdict_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu_decode_choice, "time_both", time_both)
    return timing


def choose(requested="auto", kv_cache_dtype="auto", **changes):
    shapes = SHAPES | changes
    return cpu_decode_choice.choose(requested, *shapes.values(), kv_cache_dtype)


def test_the_verdict_is_measured_once_then_read_from_its_file(verdicts, caplog):
    caplog.set_level("INFO", logger="batchpilot.engine")
    assert choose() == "torch"  # the fake: kernel 2 ms, torch 1 ms
    verdicts.fake(1.0, 2.0)  # a second timing would now pick the kernel
    assert choose() == "torch"
    assert len(verdicts.calls) == 1
    assert len(list(verdicts.dir.glob("decode-verdict-*.json"))) == 1
    lines = [r.getMessage() for r in caplog.records if "CPU decode attention" in r.message]
    assert "kernel 2.00 ms vs torch 1.00 ms" in lines[0] and lines[0].endswith("(measured)")
    assert lines[1].endswith("using torch (cached)")
    # Other shapes or another dtype are measured on their own.
    assert choose(head_dim=32) == "cpu_kernel"
    assert choose(dtype=torch.bfloat16) == "cpu_kernel"
    assert len(verdicts.calls) == 3


def test_a_forced_choice_overrides_the_verdict(verdicts):
    verdicts.fake(2.0, 1.0)
    assert choose() == "torch"
    assert choose("cpu_kernel") == "cpu_kernel"
    assert choose("torch") == "torch"
    assert len(verdicts.calls) == 1
    with pytest.raises(ValueError, match="fp8"):
        choose("cpu_kernel", kv_cache_dtype="fp8")
    assert choose(kv_cache_dtype="fp8") == "torch"  # FP8 caches dequantize in torch
    assert len(verdicts.calls) == 1


def test_cpu_kernel_is_for_cpus_only():
    from batchpilot.server.attention import resolve_backend

    assert resolve_backend("cpu_kernel", torch.device("cpu"), "auto") == "cpu_kernel"
    with pytest.raises(ValueError, match="CPU"):
        resolve_backend("cpu_kernel", torch.device("cuda"), "auto")


def test_an_unwritable_cache_still_decides(verdicts, monkeypatch):
    blocker = verdicts.dir / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(cpu_decode_choice, "verdict_dir", lambda: blocker / "below")
    verdicts.fake(1.0, 2.0)
    assert choose() == choose() == "cpu_kernel"
    assert len(verdicts.calls) == 2


def test_the_timing_runs_both_paths_quickly():
    import time

    start = time.perf_counter()
    kernel_ms, torch_ms = cpu_decode_choice.time_both(*SHAPES.values())
    assert kernel_ms > 0 and torch_ms > 0
    assert time.perf_counter() - start < 10  # ~1 s budget; generous for a loaded machine


def generate(model, **config):
    from batchpilot.server import LLM, SamplingParams
    from tests.support.engine import PROMPTS

    llm = LLM(model, dtype="float32", max_model_len=128, **config)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return llm, llm.generate(PROMPTS[:4], params, use_tqdm=False)


@pytest.mark.parametrize(
    ("backend", "kernel_ms", "torch_ms", "used"),
    [
        ("auto", 2.0, 1.0, "torch"),  # a cached torch verdict
        ("auto", 1.0, 2.0, "cpu_kernel"),
        ("cpu_kernel", 2.0, 1.0, "cpu_kernel"),  # forced, against the verdict
        ("torch", 1.0, 2.0, "torch"),
    ],
)
def test_the_runner_decodes_through_the_chosen_path(
    verdicts, monkeypatch, tiny_model, hf_greedy, backend, kernel_ms, torch_ms, used
):
    verdicts.fake(kernel_ms, torch_ms)
    kernel_calls = []
    real = cpu_decode.paged_decode
    monkeypatch.setattr(cpu_decode, "paged_decode",
                        lambda *a: kernel_calls.append(1) or real(*a))  # fmt: skip
    llm, outs = generate(tiny_model, attention_backend=backend)
    assert llm.engine.runner.attention_backend == used
    assert bool(kernel_calls) == (used == "cpu_kernel")
    for out in outs:  # greedy equals transformers either way
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, 8)


@pytest.mark.parametrize("condition", ["chunked_prefill", "preempt_swap"])
def test_the_kernel_keeps_greedy_equal_to_transformers_in_mixed_steps(tiny_model, hf_greedy,
                                                                      condition):  # fmt: skip
    """Steps that decode some sequences while prefilling others, and sequences swapped out
    and back in: the kernel's one bucket of decodes beside the torch path's prefills."""
    from tests.support.engine import CONDITIONS

    llm, outs = generate(tiny_model, attention_backend="cpu_kernel", **CONDITIONS[condition])
    assert llm.engine.runner.attention_backend == "cpu_kernel"
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, 8)


def test_verdicts_live_in_the_extensions_cache_keyed_by_the_kernels_build_target(
    monkeypatch, tmp_path
):
    # A prebuilt kernel's folder is in the image, read-only: verdicts go to the writable
    # $TORCH_EXTENSIONS_DIR the operator mounts, whichever build was loaded.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_decode_choice.verdict_dir() == tmp_path
    shapes = dict(num_heads=9, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)
    keys = set()
    for target in ("x86-64-v3", "x86-64-v4", "native"):
        monkeypatch.setattr(
            cpu_decode, "load", lambda t=target: SimpleNamespace(batchpilot_target=t)
        )
        keys.add(cpu_decode_choice.verdict_key(shapes))
    assert len(keys) == 3  # an AVX2 build's timing is not an AVX-512 build's
