"""Llama-family variants load and match transformers (Qwen3 and Gemma also under chunked
prefill, preemption and a LoRA adapter); other architectures are refused."""

import json

import pytest
import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model.loader import UnsupportedModelError, load_hf_model
from tests.support.engine import CONDITIONS, PROMPTS
from tests.support.models import make_adapter, make_tiny_llama, peft_greedy

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
    # per-head q/k RMSNorm before RoPE; untied embeddings as Qwen3's config defaults
    "qwen3": dict(model_type="qwen3", random_norms=True),
    # (1 + w) RMSNorm, sqrt(hidden) embedding scale, tanh GELU, tied embeddings
    "gemma": dict(model_type="gemma", hidden_act="gelu_pytorch_tanh", random_norms=True),
}
NEW_FAMILIES = ("qwen3", "gemma")


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


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_tiny_llama(root / name, **VARIANTS[name]) for name in NEW_FAMILIES}


@pytest.fixture(scope="module")
def family_greedy(family_models):
    """transformers greedy continuations per (family, prompt ids, max tokens), cached."""
    cache: dict[tuple, list[int]] = {}

    def generate(family: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (family, tuple(prompt_ids), max_tokens)
        if key not in cache:
            cache[key] = peft_greedy(family_models[family], None, prompt_ids, max_tokens)
        return cache[key]

    return generate


@pytest.mark.parametrize("condition", ["chunked_prefill", "preempt_swap", "preempt_recompute"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_new_family_matches_transformers_under_chunking_and_preemption(
    family_models, family_greedy, family, condition
):
    llm = LLM(family_models[family], dtype="float32", max_model_len=128, **CONDITIONS[condition])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert out.outputs[0].token_ids == family_greedy(family, out.prompt_token_ids, 24)
    if condition.startswith("preempt"):
        assert llm.stats().num_preemptions > 0


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_new_family_with_a_lora_adapter_matches_peft(family_models, family_greedy, family,
                                                     tmp_path):  # fmt: skip
    base = family_models[family]
    adapter = make_adapter(base, tmp_path / "adapter", rank=8, seed=1)
    llm = LLM(base, dtype="float32", max_model_len=128, enable_lora=True, max_loras=1)
    llm.add_lora("a", adapter)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in llm.generate(PROMPTS[:3], params, use_tqdm=False, lora="a"):
        ids = out.prompt_token_ids
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, ids, 12)
        assert out.outputs[0].token_ids != family_greedy(family, ids, 12)  # the adapter acts


def tiny_model_of_type(tmp_path, model_type: str, architecture: str) -> str:
    """A tiny Llama whose config claims another architecture."""
    path = make_tiny_llama(tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    config.update(model_type=model_type, architectures=[architecture])
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
    return path


def test_unsupported_architecture_fails_at_load_with_a_clear_message(tmp_path):
    path = tiny_model_of_type(tmp_path, "gpt2", "GPT2LMHeadModel")
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture 'gpt2'.*llama"):
        LLM(path)


def test_gemma2_is_refused_with_the_reason_and_what_runs(tmp_path):
    path = tiny_model_of_type(tmp_path, "gemma2", "Gemma2ForCausalLM")
    with pytest.raises(UnsupportedModelError, match=r"'gemma2'.*soft-capping.*qwen3, gemma"):
        LLM(path)


def test_missing_model_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither a directory, a \.gguf file"):
        LLM(str(tmp_path / "nope"))


def test_sliding_window_beyond_max_model_len_is_refused(tmp_path):
    path = make_tiny_llama(tmp_path / "mistral", model_type="mistral", sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window attention"):
        LLM(path, max_model_len=128)
    assert LLM(path, max_model_len=64).engine.config.max_model_len == 64
