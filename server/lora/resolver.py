"""vLLM's filesystem LoRA resolver: an adapter a request names that is not loaded is looked
up as `<dir>/<name>/` (a PEFT directory: adapter_config.json and its safetensors) and, when
there, loaded on first use (server/api/lora.py does the loading).

The name comes from any client, so nothing of it reaches the filesystem unchecked: it is
one path component (letters, digits and `._:-`, starting with a letter or digit, at most
MAX_NAME_CHARS: no `/`, no `..`, never absolute), and the directory it names, and the two
files the loader reads in it, must resolve (symlinks followed) to places inside the
resolver directory. A name that fails any of this is simply not found."""

import os
import re
from pathlib import Path

MAX_NAME_CHARS = 128
NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_NAME_CHARS - 1}}}")
# What load_adapter reads: checked too, so that a symlink inside an adapter cannot point
# the loader outside the directory.
FILES = ("adapter_config.json", "adapter_model.safetensors")


def find_adapter(root: str, name: str) -> Path | None:
    """The adapter directory `name` resolves to under root (real path), or None where there
    is none or the name may not name one. Reads metadata only (a few stat calls)."""
    if len(name) > MAX_NAME_CHARS or not NAME.fullmatch(name):
        return None
    try:
        base = Path(os.path.realpath(root))
        adapter = Path(os.path.realpath(base / name))
        if adapter.parent != base or not adapter.is_dir():
            return None  # a symlink out of the directory, or into a subdirectory of it
        for file in FILES:
            real = Path(os.path.realpath(adapter / file))
            if not real.is_relative_to(base) or not real.is_file():
                return None
    except (OSError, ValueError):  # a loop of symlinks, a name the OS refuses
        return None
    return adapter
