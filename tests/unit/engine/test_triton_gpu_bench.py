"""server/bench/gpu.py on a machine without a GPU: its arguments, its refusal, its table."""

import pytest

from batchpilot.server.bench import gpu


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--batch-sizes" in out and "--budget-s" in out


def test_arguments_parse():
    args = gpu.parse_args(["--batch-sizes", "1,8", "--skip", "engine,quality"])
    assert args.batch_sizes == (1, 8) and args.skip == {"engine", "quality"}


def test_without_cuda_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().out


def test_table_shows_only_used_columns():
    rows = [
        {"section": "kernels", "kernel": "decode", "kv": "auto", "us": 12.345, "of_copy": 0.71},
        {"section": "engine", "model": "m", "backend": "triton", "tok_s": 1234.5},
    ]
    text = gpu.render(rows)
    assert "12.3" in text and "71%" in text and "1234" in text
    assert "perplexity" not in text and "TFLOP/s" not in text


def test_agreement_counts_sequences_over_all_batches():
    torch_ids = [[[1] * 20], [[2] * 20, [3] * 20]]
    other = [[[1] * 20], [[2] * 16 + [9] * 4, [3] * 4 + [9] * 16]]  # differs at 17th, 5th
    assert gpu._agreement(torch_ids, other) == (2, 3)
