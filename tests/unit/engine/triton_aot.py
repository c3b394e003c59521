"""Compile the Triton kernels ahead of time for an NVIDIA architecture, with no GPU:
Triton's compiler and ptxas run on the CPU, so a kernel that would not build for the
device (an op the backend lacks, a dtype the architecture lacks) fails here.

    python tests/unit/engine/triton_aot.py 90 [--all]

Must run without TRITON_INTERPRET, so test_triton_compile.py runs it in a subprocess.
The default set is the serving configurations (bf16 and fp8 e4m3, the shapes of
Llama-3-8B's attention); --all adds fp8 e5m2 and float32 (about a minute more).
"""

import os
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchpilot.server.attention.triton_decode import _decode_kernel, _merge_splits_kernel
from batchpilot.server.attention.triton_extend import _extend_kernel
from batchpilot.server.attention.triton_kv_write import _kv_write_kernel

SHAPE = dict(HEAD_DIM=128, DIM_P2=128)
# (model dtype, fp8 format or None, dot dtype, dot precision, pipeline stages)
SERVING = [("bf16", None, tl.bfloat16, "tf32", 3), ("bf16", tl.float8e4nv, tl.bfloat16, "tf32", 3)]
EXTRA = [("bf16", tl.float8e5, tl.bfloat16, "tf32", 3), ("fp32", None, tl.float32, "ieee", 2)]


def compile_kernel(fn, target, types: dict, constexprs: dict, **options) -> None:
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    keyed = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    triton.compile(ASTSource(fn, signature, keyed), target=target, options=options)
    print(f"ok {fn.__name__} {constexprs.get('FP8_DTYPE', '')} {types.get('q_ptr', '')}")


def compile_all(arch: int, variants) -> None:
    target = GPUTarget("cuda", arch, 32)
    for dtype, fp8, dot_dtype, precision, stages in variants:
        if fp8 is tl.float8e4nv and arch < 89:  # as resolve_backend: the torch path there
            continue
        cache = "*u8" if fp8 else f"*{dtype}"
        kernel_opts = dict(FP8=fp8 is not None, FP8_DTYPE=fp8 or tl.float32,
                           DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, **SHAPE)  # fmt: skip
        common = dict(q_ptr=f"*{dtype}", k_cache_ptr=cache, v_cache_ptr=cache, tables_ptr="*i32",
                      k_scale_ptr="*fp32", v_scale_ptr="*fp32", out_ptr=f"*{dtype}",
                      qk_scale="fp32", q_token_stride="i32", q_head_stride="i32",
                      cache_head_stride="i32", cache_slot_stride="i32", table_stride="i32",
                      out_token_stride="i32")  # fmt: skip
        decode = dict(common, context_lens_ptr="*i32", part_out_ptr="*fp32",
                      part_lse_ptr="*fp32", tokens_per_split="i32", num_splits="i32")  # fmt: skip
        for split in (False, True):
            compile_kernel(_decode_kernel, target, decode,
                           dict(SPLIT=split, GROUP=4, GROUP_P2=16, BLOCK_SIZE=16, BLOCK_N=64,
                                **kernel_opts), num_stages=stages)  # fmt: skip
        extend = dict(common, k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", chunk_rows_ptr="*i32",
                      chunk_lens_ptr="*i32", prefix_lens_ptr="*i32", new_token_stride="i32",
                      new_head_stride="i32")  # fmt: skip
        compile_kernel(_extend_kernel, target, extend,
                       dict(GROUP=4, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, **kernel_opts),
                       num_stages=stages)  # fmt: skip
        bias, mantissa, fp8_max = {tl.float8e4nv: (7, 3, 448.0), tl.float8e5: (15, 2, 57344.0)}.get(
            fp8, (0, 0, 0.0))  # fmt: skip
        write = dict(k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", k_cache_ptr=cache, v_cache_ptr=cache,
                     slots_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                     new_token_stride="i32", new_head_stride="i32", cache_head_stride="i32",
                     cache_slot_stride="i32")  # fmt: skip
        compile_kernel(_kv_write_kernel, target, write,
                       dict(NUM_KV_HEADS=8, HEADS_P2=8, FP8=fp8 is not None, FP8_BIAS=bias,
                            FP8_MANTISSA=mantissa, FP8_MAX=fp8_max, **SHAPE))  # fmt: skip
    merge = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16",
                 out_token_stride="i32", num_splits="i32")  # fmt: skip
    compile_kernel(_merge_splits_kernel, target, merge, dict(SPLITS_P2=8, **SHAPE))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter compiles nothing"
    compile_all(int(sys.argv[1]), SERVING + (EXTRA if "--all" in sys.argv else []))
