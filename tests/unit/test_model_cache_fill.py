"""`batchpilot model cache` (server/model/cache_fill.py) on a plain directory source: the
copy, the completion marker, the rename into place, and what it does with a directory
already there. Loading a filled cache like the bundled model is
tests/integration/test_model_cache_bundled.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot.cli import main
from batchpilot.server.model import cache_fill
from batchpilot.server.model.cache_fill import MARKER, fill, filled


@pytest.fixture
def source(tmp_path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "sub" / "tokenizer.json").write_text("{}")
    (src / ".cache").mkdir()  # a Hugging Face download's bookkeeping: not copied
    return src


def test_fill_copies_then_marks_complete(source, tmp_path):
    out = tmp_path / "claim" / "model-abc"
    assert fill(str(source), out) == out
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    assert (out / "sub" / "tokenizer.json").is_file()
    assert not (out / ".cache").exists()
    assert json.loads((out / MARKER).read_text()) == {"source": str(source)}
    assert [p.name for p in out.parent.iterdir()] == ["model-abc"]  # no partial left


def test_a_filled_directory_is_left_as_it_is(source, tmp_path):
    out = tmp_path / "model"
    fill(str(source), out)
    (source / "config.json").write_text("changed")
    fill(str(source), out)
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'


def test_a_directory_without_the_marker_is_filled_anew(source, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "half.safetensors").write_text("x")
    fill(str(source), out)
    assert filled(out) and not (out / "half.safetensors").exists()


def test_losing_the_race_to_another_fill_is_success(source, tmp_path, monkeypatch):
    out = tmp_path / "model"
    write = cache_fill._write_model

    def other_fill_first(src: str, target: Path) -> None:
        write(src, target)
        out.mkdir()
        (out / MARKER).write_text("{}")  # another Job's rename landed meanwhile

    monkeypatch.setattr(cache_fill, "_write_model", other_fill_first)
    assert fill(str(source), out) == out and filled(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_missing_source_fails_and_leaves_nothing(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(FileNotFoundError):
        fill(str(tmp_path / "absent"), out)
    assert list(tmp_path.iterdir()) == []


def test_the_command(source, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["model", "cache", "--source", str(source), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and filled(out)
