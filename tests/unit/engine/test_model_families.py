"""Llama-family variants load and match transformers; other architectures are refused."""

import json

import pytest
import torch
from tiny_llama import make_tiny_llama

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model.loader import UnsupportedModelError, load_hf_model

VARIANTS = {
    "qwen2": dict(model_type="qwen2"),  # q/k/v projections carry biases
    "mistral": dict(model_type="mistral", sliding_window=None),
    "llama3_rope_scaling": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "untied_embeddings": dict(tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_transformers(tmp_path, variant):
    path = make_tiny_llama(tmp_path / variant, **VARIANTS[variant])
    hf, _ = load_hf_model(path, torch.float32)
    prompts = ["Hello there, general", "请解释一下机器学习" * 3]
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=16, eos_token_id=None)  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_unsupported_architecture_fails_at_load_with_a_clear_message(tmp_path):
    path = make_tiny_llama(tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture 'gpt2'.*llama"):
        LLM(path)


def test_missing_model_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither a directory, a \.gguf file"):
        LLM(str(tmp_path / "nope"))


def test_sliding_window_beyond_max_model_len_is_refused(tmp_path):
    path = make_tiny_llama(tmp_path / "mistral", model_type="mistral", sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window attention"):
        LLM(path, max_model_len=128)
    assert LLM(path, max_model_len=64).engine.config.max_model_len == 64
