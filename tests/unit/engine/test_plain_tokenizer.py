"""The server's tokenizer read by the tokenizers library itself (a start-up cut): the same
tokens, text, chat prompts and special ids as transformers' tokenizer of the same files,
the same sandbox for templates, no transformers import, and transformers wherever its
class would change something."""

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from batchpilot.server.model import loader
from batchpilot.server.model.plain_tokenizer import PlainTokenizer, open_plain

TEXTS = ["Hello, 世界! def f(x):\n    return x", "", " leading  spaces\t\ttabs  ",
         "<|im_start|>user\nliteral special tokens<|im_end|>", "émoji 🙂 and ‽"]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "世界 🙂"}],
]  # fmt: skip
# Loop controls, namespace, tojson (non-ASCII kept), raise_exception, tools/documents passed
# as None, and the special tokens as variables.
TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}{% if tools is defined %}[tools={{ tools }}]"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ raise_exception('no tools here') }}{% endif %}{% if m.content == 'skip' %}{% continue %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bundled() -> Path:
    return Path(loader.resolve_source(None)[0])


@pytest.fixture(scope="module")
def pair(bundled):
    return loader.serving_tokenizer(str(bundled), None), AutoTokenizer.from_pretrained(bundled)


def copy_tokenizer(bundled: Path, target: Path, template: str | None = None, **settings) -> Path:
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(bundled / name, target / name)
    if template is not None:
        (target / "chat_template.jinja").write_text(template)
    data = json.loads((bundled / "tokenizer_config.json").read_text()) | settings
    (target / "tokenizer_config.json").write_text(json.dumps(data))
    return target


def test_the_bundled_model_reads_plain(pair):
    plain, auto = pair
    assert isinstance(plain, PlainTokenizer)
    assert len(plain) == len(auto) and plain.get_vocab() == auto.get_vocab()
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(plain, name) == getattr(auto, name), name
        assert getattr(plain, f"{name}_id") == getattr(auto, f"{name}_id"), name


@pytest.mark.parametrize("text", TEXTS)
def test_tokens_and_text_match_transformers(pair, text):
    plain, auto = pair
    for special in (True, False):
        ids = plain(text, add_special_tokens=special)["input_ids"]
        assert ids == auto(text, add_special_tokens=special)["input_ids"]
    ids = auto(text)["input_ids"] + [plain.eos_token_id, 0, 1]
    for skip in (True, False):
        assert plain.decode(ids, skip_special_tokens=skip) == auto.decode(
            ids, skip_special_tokens=skip
        )
    assert plain.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert plain.decode(ids[0]) == auto.decode(ids[0])


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("prompt", [True, False])
def test_chat_prompts_match_transformers(pair, chat, prompt):
    plain, auto = pair
    kw = dict(add_generation_prompt=prompt)
    assert plain.apply_chat_template(chat, tokenize=False, **kw) == (
        auto.apply_chat_template(chat, tokenize=False, **kw)
    )
    assert (
        plain.apply_chat_template(chat, **kw)["input_ids"]
        == (auto.apply_chat_template(chat, **kw)["input_ids"])
    )
    kw["return_dict"] = False
    assert plain.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)


def test_continuing_the_final_message_matches_transformers(pair):
    plain, auto = pair
    chat = [*CHATS[1], {"role": "assistant", "content": "Sure, the answer is "}]
    kw = dict(continue_final_message=True, tokenize=False)
    assert plain.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)
    with pytest.raises(ValueError):
        plain.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)


def test_a_template_using_the_environment_matches_transformers(tmp_path, bundled):
    directory = copy_tokenizer(bundled, tmp_path, TEMPLATE)
    plain, auto = open_plain(directory), AutoTokenizer.from_pretrained(directory)
    chat = [*CHATS[1], {"role": "user", "content": "skip"}, {"role": "user", "content": "é"}]
    for prompt in (True, False):
        kw = dict(add_generation_prompt=prompt, tokenize=False)
        assert plain.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)
    tool_turn = [{"role": "tool", "content": "x"}]
    for tokenizer in (plain, auto):
        with pytest.raises(jinja2.TemplateError, match="no tools here"):
            tokenizer.apply_chat_template(tool_turn)


@pytest.mark.parametrize("escape", ["{{ ''.__class__.__mro__ }}",
                                    "{% set ns = namespace(_x=1) %}{{ ns }}",
                                    "{{ messages.append(1) }}"])  # fmt: skip
def test_templates_run_in_the_same_sandbox(tmp_path, bundled, escape):
    directory = copy_tokenizer(bundled, tmp_path, escape)
    for tokenizer in (open_plain(directory), AutoTokenizer.from_pretrained(directory)):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tokenizer.apply_chat_template(CHATS[0], tokenize=False)


@pytest.mark.parametrize(
    "template, settings",
    [
        (None, {"add_bos_token": True}),  # transformers rewrites the post-processor
        (None, {"clean_up_tokenization_spaces": True}),
        (None, {"tokenizer_class": "LlamaTokenizer"}),
        (None, {"bos_token": "<not-a-token>"}),  # transformers adds it to the vocabulary
        (None, {"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}),
        ("{% generation %}{{ messages }}{% endgeneration %}", {}),
    ],
)
def test_anything_else_goes_to_transformers(tmp_path, bundled, template, settings):
    directory = copy_tokenizer(bundled, tmp_path, template, **settings)
    assert open_plain(directory) is None
    assert not isinstance(loader.serving_tokenizer(str(directory), None), PlainTokenizer)


def test_it_pickles_for_the_engine_process(pair):
    plain = pickle.loads(pickle.dumps(pair[0]))
    chat = CHATS[1]
    assert plain.apply_chat_template(chat) == pair[0].apply_chat_template(chat)


def test_loading_it_imports_no_transformers(bundled):
    probe = (
        "import sys; from batchpilot.server.model import loader; "
        f"t = loader.serving_tokenizer({str(bundled)!r}, None); "
        "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); "
        "print(type(t).__name__, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd="/")  # fmt: skip
    assert out.stdout.split() == ["PlainTokenizer", "False"], out.stdout
