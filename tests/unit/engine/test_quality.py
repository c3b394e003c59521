"""`batchpilot bench quality` on the tiny model: its perplexity through prompt logprobs
equals transformers' perplexity of the same windows, and fp8 rows are reported against
the unquantized cache."""

import math

import pytest
import torch

from batchpilot.server.bench.quality import measure, render
from batchpilot.server.model.loader import load_hf_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 12
WINDOW = 64


def hf_perplexity(model_dir: str) -> float:
    model, tokenizer = load_hf_model(model_dir, torch.float32)
    ids = tokenizer(TEXT)["input_ids"]
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW]
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([window])).logits[0].float(), -1)
        nll -= logprobs[torch.arange(len(window) - 1), torch.tensor(window[1:])].sum().item()
        n += len(window) - 1
    return math.exp(nll / n)


def test_perplexity_matches_transformers_and_fp8_is_relative(tiny_model):
    result = measure(tiny_model, TEXT, ("float32",), ("auto", "fp8"), WINDOW, 16)
    auto, fp8 = result["rows"]
    assert auto["perplexity"] == pytest.approx(hf_perplexity(tiny_model), rel=1e-4)
    assert auto["relative_change"] == 0.0 and auto["tokens"] == fp8["tokens"]
    assert fp8["relative_change"] == fp8["perplexity"] / auto["perplexity"] - 1.0
    assert "fp8" in render(result)
