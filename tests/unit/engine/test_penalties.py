"""vLLM's logits processors: each one changes the logits exactly as its formula says,
row by row, within one batched call."""

import math

import torch

from batchpilot.server.sampling.penalties import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    token_counts,
)

VOCAB = 7


def _logits(rows: int = 3) -> torch.Tensor:
    return torch.linspace(-3.0, 3.0, rows * VOCAB).reshape(rows, VOCAB)


def test_token_counts_counts_each_row():
    counts = token_counts([[1, 1, 4], [], [6]], VOCAB, "cpu")
    assert counts.tolist() == [[0, 2, 0, 0, 1, 0, 0], [0] * 7, [0, 0, 0, 0, 0, 0, 1]]


def test_penalties_follow_vllms_formula_per_row():
    logits = _logits()
    prompt = [[0, 1], [2], [3, 4]]
    output = [[1, 5, 5], [], []]
    presence, frequency, repetition = [0.5, 0.0, 0.0], [0.25, 0.0, 0.0], [1.0, 1.0, 2.0]
    expected = logits.clone()
    for row in range(3):
        for tok in range(VOCAB):
            x = expected[row, tok].item()
            if tok in prompt[row] or tok in output[row]:
                r = repetition[row]
                x = x / r if x > 0 else x * r
            count = output[row].count(tok)
            x -= frequency[row] * count + presence[row] * (count > 0)
            expected[row, tok] = x
    rows = [0, 2]  # row 1 asked for no penalty and is left alone
    apply_penalties(logits, rows, *([values[i] for i in rows]
                                    for values in (prompt, output, presence, frequency, repetition)))  # fmt: skip
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    apply_penalties(logits, [0], [[0, 1]], [[]], [0.0], [0.0], [2.0])
    assert logits.tolist() == [[1.0, -4.0, 1.0]]


def test_logit_bias_adds_to_the_named_tokens_of_its_row():
    logits = _logits()
    apply_logit_bias(logits, [{2: 5.0, 3: -100.0}, None, {0: 1.5}])
    expected = _logits()
    expected[0, 2] += 5.0
    expected[0, 3] -= 100.0
    expected[2, 0] += 1.5
    assert torch.equal(logits, expected)


def test_min_tokens_blocks_the_stop_tokens_of_rows_still_short():
    logits = _logits()
    apply_min_tokens(logits, [{1, 6}, set(), {0}])
    assert math.isinf(logits[0, 1]) and math.isinf(logits[0, 6]) and math.isinf(logits[2, 0])
    assert torch.isinf(logits).sum() == 3


def test_min_p_drops_tokens_below_the_scaled_maximum():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.5, 0.0]))
    # Row 0 keeps p >= 0.25: the first two tokens. Row 1 (min_p 0) keeps everything.
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]
    assert not torch.isinf(out[1]).any()
