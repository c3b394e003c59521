"""The fused decode step (the layers in one C++ call): the logits of the layer-by-layer path bit
for bit at every row count it takes, greedy tokens as transformers gives them, and every
step it must not take (prefills, big batches, adapter rows, fp8 caches, other families)
left to the model's own forward."""

import pytest
import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.attention import build_attention_metadata
from batchpilot.server.model import cpu_gemv, cpu_layer
from batchpilot.server.model.llama import from_hf
from batchpilot.server.model.loader import load_hf_model
from tests.support.models import make_tiny_llama

pytestmark = pytest.mark.skipif(cpu_layer.load() is None, reason="no AVX512-BF16 CPU here")

PROMPTS = [[1, 5, 9, 200, 7], [3, 4], [11] * 17, [8, 2, 600, 9, 41, 3, 77], [5] * 40]


def bf16_engine(model: str, **config):
    return LLM(model, dtype="bfloat16", max_model_len=256, **config).engine


def run(engine, prompts, max_tokens) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens + i, temperature=0, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def test_every_small_decode_step_is_fused_and_gives_the_layer_by_layer_logits(
    tiny_model, monkeypatch
):
    engine = bf16_engine(tiny_model)
    fused = engine.runner.fused
    assert fused is not None
    calls, fused_call = [], cpu_layer.FusedDecode.__call__

    def both(self, input_ids, positions, kv, meta, logits_index):
        got = fused_call(self, input_ids, positions, kv, meta, logits_index)
        # The same step again, layer by layer (its K/V writes repeat the same values).
        expected = self.model(input_ids, positions, kv, meta, logits_index)
        calls.append((len(input_ids), torch.equal(got, expected)))
        return got

    monkeypatch.setattr(cpu_layer.FusedDecode, "__call__", both)
    prompts = PROMPTS * 2  # 10 sequences: the first decode steps run past GEMV_MAX_ROWS
    run(engine, prompts, max_tokens=6)
    rows = sorted({n for n, _ in calls})
    assert all(equal for _, equal in calls), calls
    # Every row count from the last sequence alone up to the GEMV's limit, none above.
    assert rows == list(range(1, cpu_gemv.GEMV_MAX_ROWS + 1))


def test_greedy_tokens_are_transformers_in_bf16(tiny_model):
    hf = load_hf_model(tiny_model, torch.bfloat16)[0]
    outputs = run(bf16_engine(tiny_model), PROMPTS, max_tokens=12)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=12 + i, eos_token_id=None)  # fmt: skip
        assert outputs[str(i)] == expected[0, len(prompt) :].tolist(), i


def test_prefills_big_batches_adapter_rows_and_fp8_caches_are_not_fused(tiny_model, monkeypatch):
    engine = bf16_engine(tiny_model)
    fused, decisions, fits = engine.runner.fused, [], cpu_layer.FusedDecode.fits

    def recorded(self, meta, kv, lora, rows):
        decisions.append((bool(meta.prefills), fits(self, meta, kv, lora, rows)))
        return decisions[-1][-1]

    monkeypatch.setattr(cpu_layer.FusedDecode, "fits", recorded)
    run(engine, PROMPTS[:2], max_tokens=3)
    assert {fit for prefill, fit in decisions if prefill} == {False}
    assert {fit for prefill, fit in decisions if not prefill} == {True}
    runner, kv = engine.runner, engine.runner.kv_cache
    decode = build_attention_metadata(runner.attention_backend, [([0], 5, 1)], 1,
                                      runner.block_size, torch.bfloat16,
                                      runner.model.num_kv_heads, runner.device)  # fmt: skip
    assert fits(fused, decode, kv, None, 1)
    assert not fits(fused, decode, kv, object(), 1)  # a LoRA batch
    assert not fits(fused, decode, kv, None, cpu_gemv.GEMV_MAX_ROWS + 1)
    fp8 = bf16_engine(tiny_model, kv_cache_dtype="fp8").runner.kv_cache
    assert not fits(fused, decode, fp8, None, 1)


# Qwen3's q/k norms; Gemma's (1 + w) norms, embedding scale and GELU.
OTHER_FAMILIES = {
    "qwen3": dict(model_type="qwen3"),
    "gemma": dict(model_type="gemma", hidden_act="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_families_other_than_plain_llama_keep_the_layer_by_layer_path(tmp_path, family):
    path = make_tiny_llama(tmp_path / family, **OTHER_FAMILIES[family])
    hf = load_hf_model(path, torch.float32)[0]
    model = from_hf(hf, 64, torch.bfloat16, torch.device("cpu"))
    assert cpu_gemv.apply(model, "auto") == "gemv"
    assert cpu_layer.FusedDecode.of(model) is None


def test_float32_and_forced_linears_are_not_fused(tiny_model):
    assert LLM(tiny_model, dtype="float32", max_model_len=64).engine.runner.fused is None
    assert bf16_engine(tiny_model, linear_backend="torch").runner.fused is None
