"""Weights mapped straight from safetensors into the decoder (model/checkpoint.py, built in
place by model/build.py) give exactly the decoder transformers' model gave; what the map
would read differently from transformers is left to transformers."""

import json

import pytest
import torch
from safetensors.torch import save_file

from batchpilot.server.model.build import made_in_place
from batchpilot.server.model.checkpoint import RotaryTable, map_safetensors, open_checkpoint
from batchpilot.server.model.llama import from_hf
from batchpilot.server.model.loader import load_hf_model, read_config


def decoder_tensors(model) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update((k, v) for k, v in model.named_buffers() if v is not None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mapped_decoder_equals_the_one_from_transformers(tiny_model, dtype):
    hf, _ = load_hf_model(tiny_model, dtype)
    expected = decoder_tensors(from_hf(hf, 256, dtype, torch.device("cpu")))
    weights = open_checkpoint(tiny_model, read_config(tiny_model, None))
    assert weights is not None
    with made_in_place(dtype, torch.device("cpu")):
        decoder = from_hf(weights, 256, dtype, torch.device("cpu"))
    got = decoder_tensors(decoder)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype == (dtype if tensor.is_floating_point() else
                                                   tensor.dtype), name  # fmt: skip
        assert torch.equal(got[name], tensor), name
    assert decoder.lm_head.weight is decoder.embed_tokens.weight  # tied, as the config says


def test_every_tensor_maps_as_safetensors_reads_it_and_the_file_stays_as_it_was(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2).to(torch.float16),
        "i64": torch.arange(6).view(2, 3),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    before = path.read_bytes()
    mapped = map_safetensors(path)
    assert mapped.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    mapped["f32"].add_(1.0)  # a private mapping: the write stays in this process
    assert path.read_bytes() == before


def write_config(directory, **rope) -> None:
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
              "vocab_size": 32, "max_position_embeddings": 64, **rope}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def test_shards_are_all_mapped_and_the_generation_config_gives_the_eos(tmp_path):
    write_config(tmp_path)
    probe = "model.layers.0.self_attn.q_proj.weight"
    save_file({probe: torch.ones(2, 2)}, tmp_path / "a.safetensors")
    save_file({"model.norm.weight": torch.ones(2)}, tmp_path / "b.safetensors")
    index = {"weight_map": {probe: "a.safetensors", "model.norm.weight": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    weights = open_checkpoint(str(tmp_path), read_config(str(tmp_path), None))
    assert dict(weights.named_parameters()).keys() == {probe, "model.norm.weight"}
    assert weights.generation_config.eos_token_id == [2, 5]


def test_what_transformers_would_read_differently_is_left_to_it(tmp_path):
    write_config(tmp_path)
    assert open_checkpoint(str(tmp_path), read_config(str(tmp_path), None)) is None  # no file
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)}, tmp_path / "model.safetensors")
    assert open_checkpoint(str(tmp_path), read_config(str(tmp_path), None)) is None  # layout
    dynamic = tmp_path / "dynamic"
    dynamic.mkdir()
    write_config(dynamic, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)},
              dynamic / "model.safetensors")  # fmt: skip
    assert open_checkpoint(str(dynamic), read_config(str(dynamic), None)) is None


@pytest.mark.parametrize("rope", [
    {},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 16}},
])  # fmt: skip
def test_the_rotary_table_is_transformers_own(tmp_path, rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    write_config(tmp_path, **rope)
    config = read_config(str(tmp_path), None)
    positions = torch.arange(64)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    for got, expected in zip(RotaryTable(config)(probe, positions),
                             LlamaRotaryEmbedding(config)(probe, positions), strict=True):  # fmt: skip
        assert torch.equal(got, expected)


def test_modules_made_in_place_take_the_dtype_and_nothing_stays_changed():
    default, init = torch.get_default_dtype(), torch.nn.init.kaiming_uniform_
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError), made_in_place(torch.bfloat16, torch.device("cpu")):
        linear = torch.nn.Linear(4, 4)
        assert linear.weight.dtype == torch.bfloat16
        assert torch.get_num_threads() == 1
        assert torch.nn.init.kaiming_uniform_ is not init  # the random init is skipped
        raise RuntimeError("a failed load")
    assert torch.get_default_dtype() == default
    assert torch.get_num_threads() == threads
    assert torch.nn.init.kaiming_uniform_ is init
    assert torch.nn.Linear(4, 4).weight.dtype == default
