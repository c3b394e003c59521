"""A tokenizer.json read by the tokenizers library itself, for the calls the server makes.

transformers' tokenizer class wraps the same Rust tokenizer, but importing transformers
costs a server 0.6 s of its start-up on 2 CPUs (its package index scans every model's
source) and loading through it another 0.3 s. Used only where transformers would add
nothing: a tokenizer.json whose tokenizer_config.json names the generic class and states
no setting beyond PLAIN_SETTINGS (transformers 5 saves a tokenizer so), special tokens
already special in tokenizer.json, and a chat template without transformers' own
{% generation %} tag. Anything else loads through transformers (open_plain returns None).
"""

import json
import re
from pathlib import Path

from tokenizers import Tokenizer

from batchpilot.server.model import chat_template

# Tokenizer classes that are transformers' generic wrapper of tokenizer.json.
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# tokenizer_config.json settings that change nothing here (or that are checked below).
PLAIN_SETTINGS = {"backend", "tokenizer_class", "model_max_length", "is_local",
                  "local_files_only", "clean_up_tokenization_spaces", "chat_template",
                  *SPECIAL_NAMES}  # fmt: skip
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class PlainTokenizer:
    """What the server calls of a transformers tokenizer, with the same results."""

    def __init__(self, tokenizer: Tokenizer, special: dict[str, str], template: str | None):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.special_tokens_map = special
        self.chat_template = template
        self._compiled = None

    def __getstate__(self):  # a compiled template does not pickle; it compiles again
        return self.__dict__ | {"_compiled": None}

    def __getattr__(self, name: str):
        """bos_token, eos_token_id and the like, as transformers names them."""
        base = name.removesuffix("_id")
        if base in SPECIAL_NAMES:
            token = self.__dict__["special_tokens_map"].get(base)
            return token if base == name or token is None else self._tokenizer.token_to_id(token)
        raise AttributeError(name)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):  # fmt: skip
        """transformers' apply_chat_template for one conversation: the text, or (tokenize)
        its ids without added special tokens (the template writes them), as
        {"input_ids": ...} unless not return_dict."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        if self._compiled is None:
            self._compiled = chat_template.compile_template(self.chat_template)
        text = chat_template.render(self._compiled, self.chat_template, conversation,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    **(self.special_tokens_map | kwargs))  # fmt: skip
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, False)


def open_plain(directory: Path) -> PlainTokenizer | None:
    """The directory's tokenizer, where PlainTokenizer reads it exactly as transformers
    would; else None."""
    settings_path = directory / "tokenizer_config.json"
    tokenizer_path = directory / "tokenizer.json"
    if not settings_path.is_file() or not tokenizer_path.is_file():
        return None
    settings = json.loads(settings_path.read_text())
    template = _template(directory, settings)
    if (settings.get("tokenizer_class") not in PLAIN_CLASSES or not PLAIN_SETTINGS.issuperset(settings)
            or settings.get("clean_up_tokenization_spaces") or template is False):  # fmt: skip
        return None
    special = {name: settings[name] for name in SPECIAL_NAMES if settings.get(name) is not None}
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    if not all(isinstance(token, str) and token in added for token in special.values()):
        return None  # transformers would add it to the vocabulary
    return PlainTokenizer(tokenizer, special, template)


def _template(directory: Path, settings: dict) -> str | bool | None:
    """The chat template transformers would use (chat_template.jinja first), None for
    none, False where PlainTokenizer cannot render it (named templates, the generation tag)."""
    if (directory / "additional_chat_templates").is_dir():
        return False
    path = directory / "chat_template.jinja"
    template = path.read_text() if path.is_file() else settings.get("chat_template")
    if template is None:
        return None
    if not isinstance(template, str) or GENERATION_TAG.search(template):
        return False
    return template
