"""Multi-LoRA in the engine: greedy output with a PEFT adapter equals transformers +
PEFT token for token (and the merged model's); mixed batches of adapters and the base
return what each request returns alone, under chunked prefill and preemption; adapters
never share KV blocks; max_loras bounds a step without starving any adapter; bad
adapters are refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.engine.admission import RequestRejected
from batchpilot.server.lora import LoRAError, LoRAFull, LoRAInUse, LoRANotFound
from tests.support.engine import CONDITIONS, PROMPTS
from tests.support.models import make_adapter, peft_greedy

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": make_adapter(tiny_model, root / "all8", rank=8, seed=1),
        "qv4": make_adapter(tiny_model, root / "qv4", rank=4, seed=2, modules=("q_proj", "v_proj")),
        "mlp16": make_adapter(
            tiny_model,
            root / "mlp16",
            rank=16,
            seed=3,
            use_rslora=True,
            modules=("gate_proj", "up_proj", "down_proj"),
        ),
    }


def lora_llm(model, adapters, **config) -> LLM:
    config = dict(dtype="float32", max_model_len=128, enable_lora=True, max_loras=3) | config
    llm = LLM(model, **config)
    for name, path in adapters.items():
        llm.add_lora(name, path)
    return llm


def token_ids(outs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outs]


@pytest.mark.parametrize("name", ["all8", "qv4", "mlp16"])
def test_greedy_with_an_adapter_matches_peft_and_the_merged_model(tiny_model, adapters, name):
    llm = lora_llm(tiny_model, {name: adapters[name]})
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=name)
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        assert out.outputs[0].token_ids == peft_greedy(tiny_model, adapters[name], ids, MAX_TOKENS)
        merged = peft_greedy(tiny_model, adapters[name], ids, MAX_TOKENS, merged=True)
        assert out.outputs[0].token_ids == merged
    # The adapter changes the output: the comparison above could not pass by ignoring it.
    assert token_ids(outs) != token_ids(base)


MIXED_CONDITIONS = ("batched", "chunked_prefill", "preempt_swap", "preempt_recompute")


@pytest.mark.parametrize("condition", MIXED_CONDITIONS)
def test_a_mixed_batch_returns_what_each_request_returns_alone(tiny_model, adapters, condition):
    names = [None, "all8", "qv4", "mlp16"]
    prompts = [p for p in PROMPTS[:6] for _ in names]
    loras = [n for _ in PROMPTS[:6] for n in names]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = lora_llm(tiny_model, adapters, **CONDITIONS[condition])
    mixed = token_ids(llm.generate(prompts, params, use_tqdm=False, lora=loras))
    alone = lora_llm(tiny_model, adapters, max_loras=1, max_cpu_loras=3)
    for prompt, name, got in zip(prompts, loras, mixed, strict=True):
        assert got == token_ids(alone.generate(prompt, params, use_tqdm=False, lora=name))[0]
    if condition.startswith("preempt"):
        assert llm.stats().num_preemptions > 0


def test_adapters_never_share_kv_blocks(tiny_model, adapters):
    llm = lora_llm(tiny_model, adapters)
    engine = llm.engine
    prompt = "You are a helpful assistant. Answer briefly and precisely. " * 3
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for request_id, name in [("base", None), ("a", "all8"), ("b", "qv4"), ("a2", "all8")]:
        engine.add_request(request_id, prompt, params, lora_name=name)
    engine.step()  # all four prefilled in one step, every one still running
    tables = {s.request_id: s.block_table for s in engine.scheduler.running}
    full = len(engine.tokenizer(prompt)["input_ids"]) // 16
    assert full >= 2 and len(tables) == 4
    blocks = {rid: set(table[:full]) for rid, table in tables.items()}
    assert not blocks["base"] & blocks["a"] and not blocks["a"] & blocks["b"]
    assert not blocks["base"] & blocks["b"]
    assert blocks["a"] == blocks["a2"]  # one adapter's requests do share their prefix


def test_max_loras_bounds_each_step_and_starves_no_adapter(tiny_model, adapters):
    llm = lora_llm(tiny_model, adapters, max_loras=1, max_cpu_loras=3)
    slots = llm.engine.runner.lora_slots
    per_step = []
    batch = slots.batch
    slots.batch = lambda rows: per_step.append({a.name for a in rows if a}) or batch(rows)
    names = ["all8", "qv4", "all8", "mlp16", None, "qv4"] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=names)
    assert all(out.outputs[0].finish_reason == "length" for out in outs)
    assert max(len(step) for step in per_step) == 1
    assert {name for step in per_step for name in step} == {"all8", "qv4", "mlp16"}


def test_unloading_refuses_in_flight_requests_and_later_ones_get_an_error(tiny_model, adapters):
    llm = lora_llm(tiny_model, {"all8": adapters["all8"]})
    engine = llm.engine
    engine.add_request("r1", "Hello world", GREEDY, lora_name="all8")
    with pytest.raises(LoRAInUse, match="1 requests in flight"):
        engine.remove_lora("all8")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("all8")
    assert engine.list_loras() == []
    with pytest.raises(RequestRejected, match="cannot be found"):
        engine.add_request("r2", "Hello world", GREEDY, lora_name="all8")
    with pytest.raises(LoRANotFound):
        engine.remove_lora("all8")
    # Loaded again under the same name, it is a new adapter: nothing cached is reused.
    engine.add_lora("all8", adapters["qv4"])
    out = llm.generate("Hello world", GREEDY, use_tqdm=False, lora="all8")[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_model, adapters["qv4"],
                                                   out.prompt_token_ids, MAX_TOKENS)  # fmt: skip


def _broken_copy(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    dst.mkdir()
    config = json.loads((__import__("pathlib").Path(src) / "adapter_config.json").read_text())
    tensors = load_file(f"{src}/adapter_model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "adapter_model.safetensors")
    return str(dst)


def test_bad_adapters_are_refused_with_their_reason(tiny_model, adapters, tmp_path, monkeypatch):
    llm = lora_llm(tiny_model, {}, max_lora_rank=8, max_cpu_loras=3)
    src = adapters["all8"]
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 64)

    def wider(t):
        return {k: torch.zeros(v.shape[0], v.shape[1] * 2) if "lora_A" in k else v
                for k, v in t.items()}  # fmt: skip

    def embed(t):
        return t | {"base_model.model.model.embed_tokens.lora_A.weight": torch.ones(8, 64)}

    cases = {
        "no PEFT adapter at": str(tmp_path / "missing"),
        "cannot read": str(garbage),
        "another base model": _broken_copy(src, tmp_path / "wide", edit_tensors=wider),
        "unsupported weight": _broken_copy(src, tmp_path / "embed", edit_tensors=embed),
        "use_dora=True is not supported": _broken_copy(
            src, tmp_path / "dora", edit_config=lambda c: c.update(use_dora=True)),
        "rank 16 is above --max-lora-rank 8": adapters["mlp16"],
    }  # fmt: skip
    for reason, path in cases.items():
        with pytest.raises(LoRAError, match=reason):
            llm.add_lora("bad", path)
    assert llm.engine.list_loras() == []
    llm.add_lora("ok", src)
    with pytest.raises(LoRAError, match="already been loaded"):
        llm.add_lora("ok", src)
    llm.add_lora("ok2", src)
    llm.add_lora("ok3", adapters["qv4"])
    # Past --max-cpu-loras an adapter registers (read again when wanted); past the bound on
    # registered names it is refused.
    llm.add_lora("ok4", src)
    monkeypatch.setattr("batchpilot.server.lora.registry.MAX_REGISTERED_LORAS", 4)
    with pytest.raises(LoRAFull, match="4 adapters are registered, the most a server holds"):
        llm.add_lora("ok5", src)
    assert llm.engine.list_loras() == ["ok", "ok2", "ok3", "ok4"]
    # The server keeps serving after every refusal, the evicted "ok" too.
    assert llm.generate("Hello", GREEDY, use_tqdm=False, lora="ok")[0].outputs[0].token_ids


def test_lora_off_refuses_adapters(tiny_model, adapters):
    llm = LLM(tiny_model, dtype="float32", max_model_len=128)
    with pytest.raises(LoRAError, match="--enable-lora"):
        llm.add_lora("all8", adapters["all8"])
    with pytest.raises(RequestRejected, match="not enabled"):
        llm.generate("Hello", GREEDY, use_tqdm=False, lora="all8")


def test_an_hf_adapter_loads_from_the_local_cache_only(tiny_model, adapters, tmp_path,
                                                       monkeypatch):  # fmt: skip
    snapshot = tmp_path / "models--acme--tiny-lora" / "snapshots" / "0123abcd"
    shutil.copytree(adapters["qv4"], snapshot)
    (tmp_path / "models--acme--tiny-lora" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-lora" / "refs" / "main").write_text("0123abcd")
    # HF_HUB_CACHE as a pod sets it: huggingface_hub reads it once, at import.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    llm = lora_llm(tiny_model, {"cached": "hf://acme/tiny-lora"})
    out = llm.generate("Hello world", GREEDY, use_tqdm=False, lora="cached")[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_model, adapters["qv4"],
                                                   out.prompt_token_ids, MAX_TOKENS)  # fmt: skip
    with pytest.raises(LoRAError, match="not in the local HF cache"):
        llm.add_lora("absent", "hf://acme/absent-lora")
