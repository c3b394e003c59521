"""Top-N logprobs of scored tokens, in vLLM's shape."""

import torch

from batchpilot.server.sampling.logprobs import compute_logprobs, gather_logprobs


def test_gather_returns_the_scored_token_and_each_rows_top_n():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    logprobs = compute_logprobs(logits)
    out = gather_logprobs(logprobs, torch.tensor([1, 3]), [2, 0])
    # Row 0 scores token 1 (rank 3) and wants 2 alternatives: tokens 0 and 2.
    assert list(out[0]) == [1, 0, 2]
    assert [out[0][t].rank for t in (1, 0, 2)] == [3, 1, 2]
    assert abs(out[0][1].logprob - logprobs[0, 1].item()) < 1e-7
    # Row 1 scores its most likely token and wants no alternatives.
    assert list(out[1]) == [3] and out[1][3].rank == 1


def test_scored_token_inside_the_top_n_appears_once():
    logprobs = compute_logprobs(torch.tensor([[3.0, 1.0, 2.0]]))
    out = gather_logprobs(logprobs, torch.tensor([0]), [2])
    assert list(out[0]) == [0, 2]
    assert out[0][0].rank == 1


def test_compute_logprobs_is_float32_log_softmax():
    logits = torch.randn(2, 5, dtype=torch.bfloat16)
    out = compute_logprobs(logits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.log_softmax(logits.float(), dim=-1))
