"""Multi-LoRA on the bundled SmolLM2-135M-Instruct: with PEFT adapters made here (random,
non-zero, rank 8 over every projection and rank 16 over q and v), greedy output through
batchpilot equals transformers + PEFT, and the merged model, token for token, alone and
in one batch with the base model."""

import pytest

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model.loader import resolve_source
from tests.support.models import make_adapter, peft_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers."]  # fmt: skip
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def base() -> str:
    return resolve_source(None)[0]


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        "every8": make_adapter(base, root / "every8", rank=8, seed=1, alpha=4),
        "qv16": make_adapter(
            base, root / "qv16", rank=16, seed=2, alpha=8, modules=("q_proj", "v_proj")
        ),
    }


def test_greedy_with_adapters_matches_peft_and_merged(base, adapters):
    llm = LLM(None, dtype="float32", max_model_len=256, enable_lora=True, max_loras=2)
    for name, path in adapters.items():
        llm.add_lora(name, path)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]  # fmt: skip
    names = [None, "every8", "qv16"]
    batch = [(p, n) for p in prompts for n in names]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora=[n for _, n in batch])
    by_adapter = {}
    for (_, name), out in zip(batch, outs, strict=True):
        ids, got = out.prompt_token_ids, out.outputs[0].token_ids
        path = adapters.get(name)
        assert got == peft_greedy(base, path, ids, MAX_TOKENS), name
        if path is not None:
            assert got == peft_greedy(base, path, ids, MAX_TOKENS, merged=True), name
        by_adapter.setdefault(name, []).append(got)
    # Each adapter changes what the model says, so the equalities above test it.
    assert by_adapter[None] != by_adapter["every8"] and by_adapter[None] != by_adapter["qv16"]
