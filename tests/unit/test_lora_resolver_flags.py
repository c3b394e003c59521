"""--lora-resolver-dir: one knob (EngineConfig.lora_resolver_dir, its flag) that vLLM's
VLLM_LORA_RESOLVER_CACHE_DIR sets too, the flag winning; it turns LoRA on by itself."""

from __future__ import annotations

import argparse

import pytest

from batchpilot.server.api.cli import LORA_RESOLVER_DIR_ENV, add_arguments, run
from batchpilot.server.config import ConfigError, EngineConfig, config_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_variable_sets_the_directory_and_the_flag_overrides_it(monkeypatch, tmp_path):
    monkeypatch.delenv(LORA_RESOLVER_DIR_ENV, raising=False)
    assert parse([]).lora_resolver_dir is None
    monkeypatch.setenv(LORA_RESOLVER_DIR_ENV, "")
    assert parse([]).lora_resolver_dir is None  # set but empty: none, as vLLM reads it
    monkeypatch.setenv(LORA_RESOLVER_DIR_ENV, str(tmp_path))
    assert parse([]).lora_resolver_dir == str(tmp_path)
    args = parse(["--lora-resolver-dir", "/elsewhere"])
    assert args.lora_resolver_dir == "/elsewhere"
    config = config_from_args(parse([]))
    assert config.lora_resolver_dir == str(tmp_path) and config.enable_lora


def test_the_knob_turns_lora_on_and_is_bounded():
    assert not EngineConfig().enable_lora
    assert EngineConfig(lora_resolver_dir="/adapters").enable_lora
    with pytest.raises(ConfigError, match="lora_resolver_dir"):
        EngineConfig(lora_resolver_dir="/" + "a" * 5000)


def test_a_directory_that_is_not_one_stops_the_start(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(LORA_RESOLVER_DIR_ENV, raising=False)
    file = tmp_path / "file"
    file.write_text("")
    for path in (tmp_path / "missing", file):
        assert run(parse(["--lora-resolver-dir", str(path)])) == 2
        assert "is not a directory" in capsys.readouterr().err
