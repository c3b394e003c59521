import pytest
import torch

from batchpilot.server.model.loader import load_hf_model
from tests.support.models import make_tiny_llama


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
