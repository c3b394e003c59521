"""`batchpilot model cache`: write a model once into a directory the server loads fast,
as the operator's fill Job does on a model cache claim (spec.model.cache).

The directory holds what the loader reads quickest: safetensors weights, the config and
the tokenizer files. The bundled GGUF (and any .gguf source) is dequantized once here
instead of in every replica; a transformers directory or an hf:// repository (from a
local Hugging Face cache, offline) is copied as it is. The model is written beside the
target and renamed into place with its completion marker inside, so a target directory
either is complete or does not exist: a half-filled cache is never loaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from batchpilot.server.model.loader import load_hf_model, resolve_source

# Written last, inside the directory: its presence means the fill completed.
MARKER = ".batchpilot-cache-complete"
# Left out of a copied directory: a Hugging Face download's bookkeeping, VCS metadata.
_NOT_COPIED = shutil.ignore_patterns(".cache", ".git", ".gitattributes", MARKER)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="{cache}", required=True)
    cache = sub.add_parser(
        "cache",
        help="write a model into a directory the server loads quickly, once",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    cache.add_argument(
        "--source",
        default="bundled",
        help="bundled, a .gguf file, a transformers directory or hf://org/name (offline)",
    )
    cache.add_argument("--output", required=True, help="the directory to create")


def run(args: argparse.Namespace) -> int:
    path = fill(args.source, Path(args.output))
    print(path)
    return 0


def filled(path: Path) -> bool:
    return (path / MARKER).is_file()


def fill(source: str, output: Path) -> Path:
    """Write ``source`` into ``output`` unless it is filled already (another service's
    Job may have filled it, or be filling it now: the first rename wins)."""
    if filled(output):
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.partial-"))
    try:
        _write_model(source, partial)
        (partial / MARKER).write_text(json.dumps({"source": source}) + "\n")
        _publish(partial, output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return output


def _publish(partial: Path, output: Path) -> None:
    """Rename the complete directory into place. A target without the marker is debris
    of something else (a copy by hand): replaced."""
    if output.exists() and not filled(output):
        shutil.rmtree(output)
    try:
        partial.rename(output)
    except OSError:
        if not filled(output):  # not a concurrent fill that won the race
            raise


def _write_model(source: str, target: Path) -> None:
    if source.startswith("hf://"):
        _copy_dir(_hf_snapshot(source.removeprefix("hf://")), target)
        return
    directory, gguf_file = resolve_source(source)  # "bundled": the loader's conversion
    if gguf_file is not None:
        _convert_gguf(str(Path(directory) / gguf_file), target)
    else:
        _copy_dir(Path(directory), target)


def _hf_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, local_files_only=True))


def _copy_dir(source: Path, target: Path) -> None:
    # Symlinks are followed: a Hugging Face snapshot links its files to blobs.
    shutil.copytree(source, target, ignore=_NOT_COPIED, dirs_exist_ok=True)


def _convert_gguf(path: str, target: Path) -> None:
    """Dequantize as the loader does for the bundled model, in float32, and save plain
    safetensors with the tokenizer."""
    import torch

    model, tokenizer = load_hf_model(path, torch.float32)
    # The weights are dequantized now: without the GGUF marker they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
