"""`batchpilot bench quality`: perplexity of a fixed text through prompt logprobs, once
per weight dtype and KV-cache dtype, and fp8's relative change against the unquantized
cache at the same weight dtype: the number the field quotes for a KV quantization.

The text is cut into windows of --window tokens, each scored as its own prompt (its
first token has nothing to be predicted from). Prefill runs in chunks of
--max-num-batched-tokens: a fresh prompt prefilled in one chunk attends over its own
unquantized K/V, so its logprobs would not see the fp8 cache at all; in chunks, every
token past the first chunk reads its whole context (its own chunk included) back from
the cache, as a decode step does.
"""

import argparse
import math
import time
from pathlib import Path

from batchpilot.server.bench.report import save_json, table

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "apache-2.0.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    split = lambda s: tuple(s.split(","))  # noqa: E731
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: bundled)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                        help="UTF-8 text to score (default: the Apache-2.0 license text)")  # fmt: skip
    parser.add_argument("--dtypes", type=split, default=("float32", "bfloat16"),
                        help="comma-separated weight dtypes")  # fmt: skip
    parser.add_argument("--kv-cache-dtypes", type=split, default=("auto", "fp8_e4m3", "fp8_e5m2"),
                        help="comma-separated KV-cache dtypes; the first is the reference")  # fmt: skip
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored prompt")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16,
                        help="prefill chunk size (see the module doc)")  # fmt: skip
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))


def run(args: argparse.Namespace) -> int:
    result = measure(args.model, args.text.read_text(encoding="utf-8"), args.dtypes,
                     args.kv_cache_dtypes, args.window, args.max_num_batched_tokens)  # fmt: skip
    result["text"] = args.text.name
    print(render(result))
    save_json(result, args.result_dir, f"quality-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0


def measure(model: str | None, text: str, dtypes, kv_cache_dtypes, window: int,
            max_num_batched_tokens: int) -> dict:  # fmt: skip
    rows = []
    for dtype in dtypes:
        reference = None
        for kv in kv_cache_dtypes:
            nll, n = score(model, text, dtype, kv, window, max_num_batched_tokens)
            ppl = math.exp(nll / n)
            reference = reference or ppl
            rows.append({"dtype": dtype, "kv_cache_dtype": kv, "tokens": n,
                         "perplexity": ppl, "relative_change": ppl / reference - 1.0})  # fmt: skip
            print(f"{dtype} weights, {kv} KV cache: perplexity {ppl:.4f} over {n} tokens",
                  flush=True)  # fmt: skip
    return {"model": model or "bundled SmolLM2-135M-Instruct", "window": window,
            "max_num_batched_tokens": max_num_batched_tokens, "rows": rows}  # fmt: skip


def score(model: str | None, text: str, dtype: str, kv_cache_dtype: str, window: int,
          max_num_batched_tokens: int) -> tuple[float, int]:  # fmt: skip
    """(summed negative log-likelihood, tokens scored) of `text` under one configuration."""
    from batchpilot.server import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=window + 1,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)  # fmt: skip
    ids = llm.get_tokenizer()(text)["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows if len(w) > 1], params,
                        use_tqdm=False)  # fmt: skip
    return negative_log_likelihood(outs)


def negative_log_likelihood(outs) -> tuple[float, int]:
    nll, n = 0.0, 0
    for out in outs:
        for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            n += 1
    return nll, n


def render(result: dict) -> str:
    headers = ["weights", "KV cache", "tokens", "perplexity", "vs unquantized KV"]
    rows = [[r["dtype"], r["kv_cache_dtype"], str(r["tokens"]), f"{r['perplexity']:.4f}",
             f"{100 * r['relative_change']:+.2f}%"] for r in result["rows"]]  # fmt: skip
    return table(headers, rows)
