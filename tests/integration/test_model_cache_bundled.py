"""A model cache filled by `batchpilot model cache` (what the operator's fill Job runs)
serves exactly what the bundled model serves: the same greedy tokens, from plain
safetensors, whether filled from `bundled` or from the GGUF file itself."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model import bundled_model_path
from batchpilot.server.model.cache_fill import fill, filled

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 16


def greedy(model: str | None) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(model, dtype="float32")
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def bundled_tokens() -> list[list[int]]:
    return greedy(None)


@pytest.mark.parametrize("source", ["bundled", "gguf"])
def test_a_filled_cache_generates_like_the_bundled_model(source, bundled_tokens, tmp_path):
    src = "bundled" if source == "bundled" else str(bundled_model_path())
    out = fill(src, tmp_path / "claim" / "smollm2")
    assert filled(out)
    files = {p.name for p in Path(out).iterdir()}
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    assert not any(f.endswith(".gguf") for f in files)
    tokens = greedy(str(out))
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == bundled_tokens
