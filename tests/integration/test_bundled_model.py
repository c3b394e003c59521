"""The bundled SmolLM2-135M-Instruct, end to end on CPU in float32.

The project's loader (the safetensors conversion cached under $BATCHPILOT_CACHE) and the
project's engine must both produce, token for token, what plain transformers produces
from the GGUF file itself, and the answer must make sense."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from batchpilot.server import LLM, SamplingParams  # noqa: E402
from batchpilot.server.model import bundled_model_path  # noqa: E402
from batchpilot.server.model.loader import load_hf_model  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def reference():
    """The plain path: transformers dequantizes the GGUF directly (~25 s), no batchpilot code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_model_path()
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompt_ids(reference) -> list[int]:
    _, tokenizer = reference
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(ids) > 5
    return list(ids)


@pytest.fixture(scope="module")
def engine():
    return LLM(None, dtype="float32")


def hf_greedy(model, prompt_ids: list[int], stop_at_eos: bool) -> list[int]:
    """transformers generate(), greedy. Without EOS it is the pure argmax chain: no
    min_new_tokens, which would mask EOS and so differ from greedy with ignore_eos."""
    ids = torch.tensor([prompt_ids])
    eos = {} if stop_at_eos else {"eos_token_id": None}
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            **eos,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_loader_gives_the_bundled_llama_with_its_chat_template(prompt_ids):
    model, tokenizer = load_hf_model(None, torch.float32)
    assert model.config.model_type == "llama"
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.chat_template, "the bundled tokenizer lost its chat template"
    ours = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    ours = ours["input_ids"] if hasattr(ours, "keys") else ours
    assert list(ours) == prompt_ids, "the converted tokenizer templates differently"


def test_loader_model_generates_like_plain_transformers(reference, prompt_ids):
    plain, _ = reference
    model, _ = load_hf_model(None, torch.float32)
    assert hf_greedy(model, prompt_ids, stop_at_eos=False) == hf_greedy(
        plain, prompt_ids, stop_at_eos=False
    )


def test_engine_greedy_16_tokens_match_plain_transformers(reference, prompt_ids, engine):
    """Exactly 16 greedy tokens, through the chat turn's end and beyond."""
    plain, tokenizer = reference
    expected = hf_greedy(plain, prompt_ids, stop_at_eos=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    completion = out.outputs[0]
    assert out.prompt_token_ids == prompt_ids
    assert len(completion.token_ids) == MAX_TOKENS == len(expected)
    assert completion.text.strip(), "empty completion"
    assert completion.finish_reason == "length"
    assert completion.token_ids == expected, (
        f"engine: {tokenizer.decode(completion.token_ids)!r}\n"
        f"transformers: {tokenizer.decode(expected)!r}"
    )


def test_engine_answer_stops_at_eos_like_transformers_and_is_coherent(
    reference, prompt_ids, engine
):
    """The way a user calls it: stop at the end of the assistant's turn."""
    plain, tokenizer = reference
    expected = hf_greedy(plain, prompt_ids, stop_at_eos=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    (out,) = engine.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == expected, (
        f"engine: {tokenizer.decode(completion.token_ids)!r}\n"
        f"transformers: {tokenizer.decode(expected)!r}"
    )
    text = completion.text.strip()
    assert text, "empty completion"
    # Coherence, not just agreement: the bundled model knows this one.
    assert "Paris" in text, text
    if expected[-1] == tokenizer.eos_token_id:
        assert completion.finish_reason == "stop"
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
