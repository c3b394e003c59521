"""Logprobs of sampled and prompt tokens, with the top-N alternatives, as vLLM returns
them.

Which distribution: the raw model's. log_softmax in float32 of the logits the model
produced, before logit_bias, penalties, temperature, min_p, top-k and top-p; that is
vLLM's default (logprobs_mode "raw_logprobs"), so a temperature-0.7 request reports the
same logprobs as a greedy one and a prompt's score does not depend on sampling knobs.

Shapes, as in vLLM: a position's logprobs are a dict token id -> Logprob holding the
top-N tokens plus the scored token (N or N + 1 entries); ranks count from 1 and a
scored token's rank is the number of tokens at least as likely. Prompt logprobs start
with None: the first prompt token has nothing to be predicted from.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]
PromptLogprobs = list[PositionLogprobs | None]


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: Sequence[int]) -> list[PositionLogprobs]:  # fmt: skip
    """logprobs: [rows, vocab]; token_ids: [rows], the token each row scores;
    num_logprobs[i]: how many alternatives row i wants. One topk for the batch, at the
    largest N; each row then keeps its own N."""
    scored = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= scored).sum(dim=-1)
    k = max(num_logprobs, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0],) * 2
    rows = zip(
        token_ids.tolist(),
        scored[:, 0].tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
        num_logprobs,
        strict=True,
    )
    return [_position(*row) for row in rows]


def _position(token: int, logprob: float, rank: int, top_ids: list[int],
              top_values: list[float], n: int) -> PositionLogprobs:  # fmt: skip
    out = {token: Logprob(logprob, rank)}
    for i, (tid, value) in enumerate(zip(top_ids[:n], top_values[:n], strict=True)):
        out.setdefault(tid, Logprob(value, i + 1))
    return out
