"""EngineConfig.live_change: what the admin API may change while the server runs, and the
bounds it checks (max_num_seqs and the step budget max_num_batched_tokens)."""

import pytest

from batchpilot.server.config import ConfigError, EngineConfig

# As a CPU engine started with a 512-token step and room for 300 sequences.
LIMITS = dict(max_num_seqs_limit=300, max_step_tokens=512)


def resolved(**kwargs) -> EngineConfig:
    config = EngineConfig(**kwargs)
    config.resolve(model_max_len=8192, device_type="cpu")
    return config


def test_the_step_budget_changes_within_the_profiled_one():
    config = resolved(max_num_seqs=16)
    assert config.max_num_batched_tokens == 512
    config.apply_live_change({"max_num_batched_tokens": 128}, **LIMITS)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (16, 128)
    config.apply_live_change({"max_num_batched_tokens": 512}, **LIMITS)
    assert config.max_num_batched_tokens == 512


def test_both_knobs_in_one_change():
    config = resolved(max_num_seqs=64)
    config.apply_live_change({"max_num_seqs": 8, "max_num_batched_tokens": 32}, **LIMITS)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (8, 32)


def test_max_num_seqs_alone_raises_a_smaller_budget_to_it():
    config = resolved(max_num_seqs=8)
    config.apply_live_change({"max_num_batched_tokens": 16}, **LIMITS)
    config.apply_live_change({"max_num_seqs": 64}, **LIMITS)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 64)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"max_num_batched_tokens": 513}, "512-token step this replica was started"),
        ({"max_num_batched_tokens": 15}, "< max_num_seqs 16"),
        ({"max_num_seqs": 32, "max_num_batched_tokens": 31}, "< max_num_seqs 32"),
        ({"max_num_batched_tokens": 0}, "integer >= 1"),
        ({"max_num_batched_tokens": "256"}, "integer >= 1"),
        ({"max_num_batched_tokens": 256.0}, "integer >= 1"),
        ({"max_num_batched_tokens": True}, "integer >= 1"),
        ({"max_num_seqs": False}, "integer >= 1"),
        ({"max_num_seqs": 301}, "at most 300"),
        ({"block_size": 8}, "cannot be changed while the server runs"),
    ],
)
def test_refused_changes_change_nothing(changes, needle):
    config = resolved(max_num_seqs=16)
    before = config.public()
    with pytest.raises(ConfigError, match=needle):
        config.apply_live_change(changes, **LIMITS)
    assert config.public() == before


def test_without_chunked_prefill_the_budget_holds_a_whole_prompt():
    config = resolved(max_model_len=256, enable_chunked_prefill=False)
    assert config.max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="max_model_len 256 needs --enable-chunked-prefill"):
        config.apply_live_change({"max_num_batched_tokens": 255}, **LIMITS)
    config.apply_live_change({"max_num_batched_tokens": 256}, **LIMITS)
    assert config.max_num_batched_tokens == 256
