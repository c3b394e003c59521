"""The GPU path measured on one CUDA device, in one run of under 8 minutes:

    python -m batchpilot.server.bench.gpu [--batch-sizes 1,16,64,256] [--json out.json]

1. Device-to-device copy bandwidth (torch copy_ of 1 GiB), the roofline for the kernels.
2. Each Triton kernel against the torch reference on a Llama-3-8B attention shape
   (32 query heads, 8 KV heads, head_dim 128, block 16, bf16) with bf16 and both fp8 KV
   caches: ||out - ref|| / ||ref||, median time (triton.testing.do_bench), achieved
   bandwidth and its share of the copy bandwidth, and the time of the torch reference.
3. End-to-end engine throughput (output tokens/s) on the bundled SmolLM2-135M and on a
   random Llama-shaped ~1.1B model built here from a config (no download), at several
   batch sizes: torch attention, Triton attention, and Triton with decode steps replayed
   from CUDA graphs; plus whether each agrees with torch on the greedy tokens.
4. Perplexity with fp8 KV against bf16 KV on the bundled model, through the quality
   benchmark's scoring (server/bench/quality.py), prefilled in 64-token chunks so later
   chunks read their prefix back from the fp8 cache. On the Triton backend a chunk's
   own K/V enter its attention unquantized (the torch path reads them back from the
   cache), so the figure covers the prefix's quantization, as in decode.

A short table comes last. Sections stop being started once --budget-s has passed.
"""

import argparse
import gc
import itertools
import json
import math
import tempfile
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
# TinyLlama-1.1B's shape, with the bundled model's tokenizer.
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, head_dim=64)  # fmt: skip
# (label, attention_backend, cuda_graphs) of each engine run.
AGREE_TOKENS = 16  # greedy tokens compared between engine variants
ENGINE_VARIANTS = (("torch", "torch", False), ("triton", "triton", False),
                   ("triton+graphs", "triton", True))  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot.server.bench.gpu",
        description="Triton kernels and the CUDA engine path, checked and timed on one GPU.",
        allow_abbrev=False,
    )
    parser.add_argument("--batch-sizes", type=ints, default=(1, 16, 64, 256),
                        help="engine batch sizes, comma-separated")  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip", type=lambda s: set(s.split(",")), default=set(),
                        help="sections to skip: kernels,engine,quality")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no new section after this many seconds")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    start = time.monotonic()
    args.deadline = start + args.budget_s
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}")
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    rows = []
    sections = [("kernels", lambda: kernel_rows(copy_bw)),
                ("engine", lambda: engine_rows(args)), ("quality", quality_rows)]  # fmt: skip
    for section, run in sections:
        if section in args.skip:
            continue
        if time.monotonic() - start > args.budget_s:
            rows.append({"section": section, "case": "skipped: over --budget-s"})
            continue
        try:
            rows += run()
        except Exception as e:  # one failing section must not hide the others' numbers
            rows.append({"section": section, "case": f"failed: {type(e).__name__}: {e}"})
        print(f"[{time.monotonic() - start:.0f} s] {section} done", flush=True)
    result = {"device": name, "copy_GBps": copy_bw / 1e9, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"\n{name}: copy {copy_bw / 1e9:.0f} GB/s, {time.monotonic() - start:.0f} s\n")
    print(render(rows))
    return 0


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read plus write) of 1 GiB."""
    import torch
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


# ---- kernels ----------------------------------------------------------------------------


class Case:
    """A step on a random paged cache: decodes with given contexts, then prefill chunks
    (cached prefix, new tokens), K/V drawn on the fp8 grid when the cache is fp8 (so the
    reference, which reads a chunk back from the cache, and the kernel, which reads the
    chunk's own K/V, see the same values)."""

    def __init__(self, kv_dtype: str, decodes=(), chunks=(), seed=0):
        import torch

        from batchpilot.server.kv.cache import KVCache

        gen = torch.Generator("cuda").manual_seed(seed)
        contexts = list(decodes) + [p + n for p, n in chunks]
        used = [-(-c // BLOCK) for c in contexts]
        kv = KVCache(1, sum(used), 0, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, kv_dtype,
                     torch.device("cuda"))  # fmt: skip
        for cache in (kv.k, kv.v):
            x = torch.randn(cache.shape, generator=gen, device="cuda")
            cache.copy_(x.to(kv.dtype).view(kv.raw_dtype) if kv.is_fp8 else x.to(kv.dtype))
        if kv.is_fp8:
            kv.k_scale.uniform_(0.01, 0.2, generator=gen)
            kv.v_scale.uniform_(0.01, 0.2, generator=gen)
        order = torch.randperm(kv.num_blocks, generator=gen, device="cuda").tolist()
        bounds = [sum(used[:i]) for i in range(len(used) + 1)]
        tables = [order[a:b] for a, b in itertools.pairwise(bounds)]
        self.seqs = [(t, c - 1, 1) for t, c in zip(tables, decodes, strict=False)]
        self.seqs += [(t, p, n) for t, (p, n) in zip(tables[len(decodes) :], chunks, strict=True)]
        self.num_decodes = len(decodes)
        self.contexts = contexts
        tokens = len(decodes) + sum(n for _, n in chunks)
        randn = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
        self.q = randn(tokens, HEADS, HEAD_DIM).bfloat16()
        self.k = self._on_grid(kv, randn(tokens, KV_HEADS, HEAD_DIM) * 2, kv.k_scale[0])
        self.v = self._on_grid(kv, randn(tokens, KV_HEADS, HEAD_DIM), kv.v_scale[0])
        self.kv = kv
        self.scale = HEAD_DIM**-0.5

    @staticmethod
    def _on_grid(kv, x, scale):
        if kv.is_fp8:
            x = (x.transpose(0, 1) / scale).to(kv.dtype).float().mul(scale).transpose(0, 1)
        return x.bfloat16()

    def metadata(self, backend: str):
        import torch

        from batchpilot.server.attention import build_attention_metadata

        return build_attention_metadata(backend, self.seqs, self.num_decodes, BLOCK,
                                        torch.bfloat16, KV_HEADS, torch.device("cuda"))  # fmt: skip


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def kernel_rows(copy_bw: float) -> list[dict]:
    long_decodes, short_decodes = [8192, 8000, 7000, 6001], [512 + 24 * i for i in range(64)]
    rows = []
    for kv_dtype in KV_DTYPES:
        for kernel, run, extra in (("write", write_row, ()),
                                   ("decode", decode_row, (short_decodes, "64 seqs")),
                                   ("decode", decode_row, (long_decodes, "4 seqs x 8k")),
                                   ("extend", extend_row, ())):  # fmt: skip
            try:
                rows.append(run(kv_dtype, copy_bw, *extra))
            except Exception as e:  # one kernel failing must not hide the others' rows
                rows.append({"section": "kernels", "kernel": kernel, "kv": kv_dtype,
                             "case": f"failed: {type(e).__name__}: {e}"[:300]})  # fmt: skip
    return rows


def write_row(kv_dtype: str, copy_bw: float) -> dict:
    import torch
    from triton.testing import do_bench

    from batchpilot.server.attention.triton_kv_write import write_kv

    case = Case(kv_dtype, chunks=[(0, 2048)], seed=1)
    kv, ref = case.kv, _clone_cache(case.kv)
    slots = case.metadata("triton").slot_mapping
    k, v = torch.randn_like(case.k) * 3, torch.randn_like(case.v)  # off the grid: rounding
    ref.write(0, slots, k, v)
    write_kv(kv, 0, slots, k, v)
    mismatched = sum((a != b).sum().item() for a, b in ((kv.k, ref.k), (kv.v, ref.v)))
    ms = do_bench(lambda: write_kv(kv, 0, slots, k, v), return_mode="median")
    ref_ms = do_bench(lambda: ref.write(0, slots, k, v), return_mode="median")
    moved = 2 * k.numel() * (k.element_size() + kv.k.element_size())
    return _kernel_row("kv write", kv_dtype, "2048 tokens",
                       f"{mismatched} bytes differ", ms, ref_ms, moved, copy_bw)  # fmt: skip


def decode_row(kv_dtype: str, copy_bw: float, contexts: list[int], label: str) -> dict:
    from triton.testing import do_bench

    from batchpilot.server.attention.paged import paged_attention
    from batchpilot.server.attention.triton_decode import decode_attention

    case = Case(kv_dtype, decodes=contexts, seed=2)
    torch_meta, meta = case.metadata("torch"), case.metadata("triton")
    ref = paged_attention(case.q, case.k, case.v, case.kv, 0, torch_meta, case.scale)
    out = ref.new_full(ref.shape, float("nan"))

    def run():
        decode_attention(case.q, case.kv, 0, meta.decode_tables, meta.context_lens, case.scale,
                         out, meta.tokens_per_split, meta.num_splits)  # fmt: skip

    run()
    err = rel_err(out, ref)
    ms = do_bench(run, return_mode="median")
    ref_ms = do_bench(lambda: paged_attention(case.q, case.k, case.v, case.kv, 0, torch_meta,
                                              case.scale), return_mode="median")  # fmt: skip
    moved = 2 * sum(contexts) * KV_HEADS * HEAD_DIM * case.kv.k.element_size()
    moved += 2 * case.q.numel() * case.q.element_size()
    return _kernel_row("decode", kv_dtype, f"{label}, {meta.num_splits} split(s)",
                       f"{err:.1e}", ms, ref_ms, moved, copy_bw)  # fmt: skip


def extend_row(kv_dtype: str, copy_bw: float) -> dict:
    from triton.testing import do_bench

    from batchpilot.server.attention.paged import paged_attention
    from batchpilot.server.attention.triton_extend import extend_attention

    chunks = [(1024, 512), (1000, 512), (0, 512), (37, 511)]
    case = Case(kv_dtype, chunks=chunks, seed=3)
    torch_meta, meta = case.metadata("torch"), case.metadata("triton")
    ref = paged_attention(case.q, case.k, case.v, case.kv, 0, torch_meta, case.scale)
    out = ref.new_full(ref.shape, float("nan"))

    def run():
        extend_attention(case.q, case.k, case.v, case.kv, 0, meta.chunk_rows, meta.chunk_lens,
                         meta.prefix_lens, meta.chunk_tables, meta.max_chunk_len, case.scale,
                         out)  # fmt: skip

    run()
    err = rel_err(out, ref)
    ms = do_bench(run, return_mode="median")
    ref_ms = do_bench(lambda: paged_attention(case.q, case.k, case.v, case.kv, 0, torch_meta,
                                              case.scale), return_mode="median")  # fmt: skip
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in chunks)  # (query, key) pairs attended
    row = _kernel_row("extend", kv_dtype, "4 chunks of 512 behind 0-1024",
                      f"{err:.1e}", ms, ref_ms, 0, copy_bw)  # fmt: skip
    row["TFLOPs"] = 4 * HEADS * HEAD_DIM * pairs / (ms * 1e-3) / 1e12
    return row


def _kernel_row(kernel, kv_dtype, case, check, ms, ref_ms, moved, copy_bw) -> dict:
    row = {"section": "kernels", "kernel": kernel, "kv": kv_dtype, "case": case,
           "check": check, "us": 1e3 * ms, "torch_us": 1e3 * ref_ms}  # fmt: skip
    if moved:
        row["GBps"] = moved / (ms * 1e-3) / 1e9
        row["of_copy"] = moved / (ms * 1e-3) / copy_bw
    return row


def _clone_cache(kv):
    import torch

    copy = type(kv).__new__(type(kv))
    copy.__dict__.update({k: v.clone() if torch.is_tensor(v) else v for k, v in vars(kv).items()})
    return copy


# ---- engine -----------------------------------------------------------------------------


def engine_rows(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in (("SmolLM2-135M", None),
                             ("random 1.1B", lambda: random_llama(Path(tmp)))):  # fmt: skip
            path = model() if callable(model) else model
            tokens = {}  # variant -> greedy ids per batch size
            for variant, backend, graphs in ENGINE_VARIANTS:
                head = {"section": "engine", "model": label, "backend": variant}
                if time.monotonic() > args.deadline:
                    rows.append({**head, "case": "skipped: over --budget-s"})
                    continue
                try:
                    ids_per_batch = []
                    for row, ids in throughput(path, backend, graphs, args):
                        rows.append({**head, **row})
                        ids_per_batch.append(ids)
                    tokens[variant] = ids_per_batch
                except Exception as e:  # a first run on new hardware: keep the other variants
                    rows.append({**head, "case": f"failed: {type(e).__name__}: {e}"[:300]})
            for variant in tokens if "torch" in tokens else ():
                same, total = _agreement(tokens["torch"], tokens[variant])
                rows.append({"section": "engine", "model": label, "backend": variant,
                             "case": f"greedy vs torch, first {AGREE_TOKENS} tokens",
                             "check": f"{same}/{total} sequences agree"})  # fmt: skip
    return rows


def random_llama(path: Path) -> str:
    """A random-weight Llama of ONE_B's shape with the bundled tokenizer, saved in bf16."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from batchpilot.server.model.loader import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_source(None)[0], local_files_only=True)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **ONE_B)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU takes a second, not a minute
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return str(path)


def throughput(model, backend: str, cuda_graphs: bool, args):
    """Yields (row, greedy token ids) per batch size, from one engine."""
    import torch

    from batchpilot.server import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", attention_backend=backend, cuda_graphs=cuda_graphs,
              max_num_seqs=max(args.batch_sizes), gpu_memory_utilization=0.6,
              max_model_len=args.prompt_len + args.output_len + 1,
              enable_prefix_caching=False)  # fmt: skip
    vocab = llm.get_tokenizer().vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warmup = [{"prompt_token_ids": [1, 2, 3]}] * 2  # Triton compiles on first use
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    for batch_size in args.batch_sizes:
        prompts = [{"prompt_token_ids": torch.randint(vocab, (args.prompt_len,),
                                                      generator=gen).tolist()}
                   for _ in range(batch_size)]  # fmt: skip
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"case": f"batch {batch_size}", "tok_s": generated / seconds,
               "ms_per_step": 1e3 * seconds / args.output_len}  # fmt: skip
        yield row, [o.outputs[0].token_ids for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _agreement(a: list[list[list[int]]], b: list[list[list[int]]]) -> tuple[int, int]:
    """(sequences whose first AGREE_TOKENS greedy tokens are equal, sequences), over all
    batches. Random-token prompts meet near-ties: on the H200, one prompt in four left
    transformers' own bf16 greedy path at its 3rd token against fp32, so a share, not
    all-or-nothing, is what tells a broken backend from bf16 rounding."""
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(x[:AGREE_TOKENS] == y[:AGREE_TOKENS] for x, y in pairs), len(pairs)


# ---- quality ----------------------------------------------------------------------------


def quality_rows() -> list[dict]:
    """bench quality's scoring, one engine at a time: each is freed before the next sizes
    its KV cache from the free memory."""
    import torch

    from batchpilot.server.bench import quality

    text = quality.DEFAULT_TEXT.read_text(encoding="utf-8")
    rows, reference = [], None
    for kv in KV_DTYPES:
        nll, n = quality.score(None, text, "bfloat16", kv, 1024, 64)
        gc.collect()
        torch.cuda.empty_cache()
        perplexity = math.exp(nll / n)
        reference = reference or perplexity
        rows.append({"section": "quality", "kv": kv, "case": f"{n} tokens, 64-token chunks",
                     "perplexity": perplexity,
                     "check": f"{100 * (perplexity / reference - 1):+.2f}% vs bf16 KV"})  # fmt: skip
    return rows


# ---- report -----------------------------------------------------------------------------

COLUMNS = [  # (key, header, format)
    ("section", "section", "{}"), ("kernel", "kernel", "{}"), ("model", "model", "{}"),
    ("backend", "backend", "{}"), ("kv", "KV", "{}"), ("case", "case", "{}"),
    ("check", "check / rel err", "{}"), ("us", "median us", "{:.1f}"),
    ("torch_us", "torch us", "{:.1f}"), ("GBps", "GB/s", "{:.0f}"),
    ("of_copy", "of copy bw", "{:.0%}"), ("TFLOPs", "TFLOP/s", "{:.1f}"),
    ("tok_s", "tok/s", "{:.0f}"), ("ms_per_step", "ms/step", "{:.2f}"),
    ("perplexity", "perplexity", "{:.4f}"),
]  # fmt: skip


def render(rows: list[dict]) -> str:
    from batchpilot.server.bench.report import table

    used = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    cells = [[_cell(r.get(key), fmt) for key, _, fmt in used] for r in rows]
    return table([header for _, header, _ in used], cells)


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return fmt.format(value)


if __name__ == "__main__":
    raise SystemExit(main())
