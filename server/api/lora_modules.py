"""The LoRA adapters a server serves (--lora-modules, --preload-lora-modules, the load
route): LoRAModule and vLLM's spellings of it, with the checks on names and paths."""

import argparse
import json
import re
from dataclasses import dataclass

# An adapter's name is a model id clients send and a metric label value: printable, short,
# no comma (GIE splits the label on commas) and no quotes or spaces.
LORA_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}")
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRAModule:
    """An adapter the server serves: its name (the `model` clients send), its directory,
    and the base model /v1/models names as its parent (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_name_error(name: str) -> str | None:
    if LORA_NAME_PATTERN.fullmatch(name):
        return None
    return (f"invalid LoRA adapter name {name!r}: 1 to 128 characters of letters, digits and "
            "._/:-, starting with a letter or digit")  # fmt: skip


def lora_path_error(path: str) -> str | None:
    if 0 < len(path) <= MAX_LORA_PATH_CHARS:
        return None
    return f"a LoRA adapter path is 1 to {MAX_LORA_PATH_CHARS} characters"


def parse_lora_module(text: str) -> LoRAModule:
    """vLLM's two spellings: name=path, or JSON {"name", "path", "base_model_name"}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            module = LoRAModule(spec["name"], spec["path"], spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(
                f'{text!r}: expected {{"name": ..., "path": ..., "base_model_name": ...}}'
            ) from e
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: expected name=path or JSON")
        module = LoRAModule(name, path)
    if not all(
        isinstance(v, str) for v in (module.name, module.path, module.base_model_name or "")
    ):
        raise argparse.ArgumentTypeError(f"{text!r}: name, path and base_model_name are strings")
    error = lora_name_error(module.name) or lora_path_error(module.path)
    if error:
        raise argparse.ArgumentTypeError(error)
    return module


MAX_PRELOAD_LORA_MODULES = 1024


def parse_lora_module_list(text: str) -> list[LoRAModule]:
    """A JSON list of vLLM's JSON spellings: [{"name", "path", "base_model_name"}, ...]."""
    try:
        items = json.loads(text) if text.strip() else []
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if (
        not isinstance(items, list)
        or len(items) > MAX_PRELOAD_LORA_MODULES
        or not all(isinstance(item, dict) for item in items)
    ):
        raise argparse.ArgumentTypeError(
            f'expected a JSON list of at most {MAX_PRELOAD_LORA_MODULES} {{"name", "path"}}'
        )
    return [parse_lora_module(json.dumps(item)) for item in items]
