import pytest
import torch
from tiny_llama import make_tiny_llama

from batchpilot.server.model.loader import load_hf_model

PROMPTS = [
    "Hello world",
    "The capital of France is",
    "请解释一下机器学习",
    "请解释一下" + "机器学习" * 5,
    "Once upon a time, in a land far away, there lived a small dragon who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2,
    "Q: What is 2 + 2?\nA:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """Reference greedy continuations from transformers generate(), cached per prompt."""
    model, tokenizer = load_hf_model(tiny_model, torch.float32)
    cache: dict[tuple, list[int]] = {}

    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            # eos_token_id=None matches ignore_eos: EOS may be chosen, it just doesn't stop.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=None)  # fmt: skip
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    generate.tokenizer = tokenizer
    return generate
