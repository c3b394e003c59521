"""The bundled model's config and tokenizer read without transformers' config classes (a
start-up cut): the same values the decoder reads, the same tokens and chat text, and no
config class imported; anything else still goes through transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from batchpilot.server.model import loader
from batchpilot.server.model.llama import Family

# What LlamaDecoder and RotaryTable read, with the defaults they read them with.
READ = {**{k: None for k in loader.PLAIN_LLAMA_KEYS}, "attention_bias": False,
        "mlp_bias": False, "head_dim": None}  # fmt: skip


@pytest.fixture(scope="module")
def bundled() -> str:
    return loader.resolve_source(None)[0]


def test_the_plain_reading_matches_llama_config(bundled):
    plain, full = loader.plain_config(bundled, None), AutoConfig.from_pretrained(bundled)
    assert plain is not None
    for key, default in READ.items():
        assert getattr(plain, key, default) == getattr(full, key, default), key
    assert Family.of(plain) == Family.of(full)


def write_config(tmp_path: Path, bundled: str, **changes) -> str:
    data = json.loads((Path(bundled) / "config.json").read_text())
    data.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del data[key]
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


@pytest.mark.parametrize(
    "changes",
    [
        {"rms_norm_eps": None},  # a key left to the class's default
        {"model_type": "qwen2"},  # another family: its class may map fields
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ],
)
def test_anything_else_goes_to_transformers(tmp_path, bundled, changes):
    assert loader.plain_config(write_config(tmp_path, bundled, **changes), None) is None


def test_the_tokenizer_is_the_one_autotokenizer_gives(bundled):
    plain, auto = loader._tokenizer(bundled, None), AutoTokenizer.from_pretrained(bundled)
    assert type(plain) is type(auto)
    text = "Hello, 世界! def f(x):\n    return x"
    assert plain(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    assert plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (plain.eos_token_id, plain.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)


def test_reading_them_imports_no_config_class(bundled):
    probe = (
        "import sys; from batchpilot.server.model import loader; "
        f"loader.read_config({bundled!r}, None); loader._tokenizer({bundled!r}, None); "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd="/")  # fmt: skip
    assert "configuration_llama" not in out.stdout, out.stdout
