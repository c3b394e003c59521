"""vLLM's logits processors, batched over the rows of one step: min_tokens, logit_bias,
repetition/frequency/presence penalties (applied before temperature, so they also
steer greedy rows) and min_p (applied after temperature, to sampled rows only).

The formulas are vLLM's:
- min_tokens: while a row has fewer than min_tokens outputs, its stop token ids
  (stop_token_ids, plus EOS unless ignore_eos) get -inf.
- logit_bias: logits[token] += bias.
- repetition_penalty r, for every token seen in the prompt or the output:
  logit / r where the logit is positive, logit * r otherwise.
- frequency_penalty f and presence_penalty p, over the output tokens only:
  logit -= f * count(token) + p * (count(token) > 0).
- min_p m, on the temperature-scaled distribution: tokens whose probability is below
  m * max probability get -inf.

Inputs are plain per-row values so the functions stay pure. Each works on float32
logits [rows, vocab] with one tensor op per knob over every row that asked for it.
"""

from collections.abc import Collection, Mapping, Sequence
from itertools import chain

import torch


def apply_min_tokens(logits: torch.Tensor, blocked: Sequence[Collection[int]]) -> None:
    """blocked[i]: the token ids row i may not sample yet (empty once it may stop)."""
    rows = [i for i, ids in enumerate(blocked) for _ in ids]
    if rows:
        tokens = list(chain.from_iterable(blocked))
        logits[_long(rows, logits), _long(tokens, logits)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> None:
    rows = [i for i, bias in enumerate(biases) for _ in bias or ()]
    if rows:
        tokens = list(chain.from_iterable(bias or () for bias in biases))
        values = list(chain.from_iterable((bias or {}).values() for bias in biases))
        index = (_long(rows, logits), _long(tokens, logits))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[int],
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], presence: Sequence[float],
                    frequency: Sequence[float], repetition: Sequence[float]) -> None:  # fmt: skip
    """rows: the rows that asked for a penalty; the other arguments hold one entry per
    row in rows, so a step without penalties builds nothing."""
    if not rows:
        return
    vocab, device = logits.shape[-1], logits.device
    prompt_counts = token_counts(prompt_token_ids, vocab, device)
    output_counts = token_counts(output_token_ids, vocab, device)
    column = lambda values: torch.tensor(values, device=device)[:, None]  # noqa: E731
    rep = column(repetition)
    sub = logits[rows]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where((prompt_counts > 0) | (output_counts > 0), penalized, sub)
    sub -= column(frequency) * output_counts + column(presence) * (output_counts > 0)
    logits[rows] = sub


def token_counts(token_ids: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab] float32 occurrence counts, by one accumulating scatter over the
    concatenated ids (no padding, no loop over rows)."""
    counts = torch.zeros(len(token_ids), vocab, device=device)
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    tokens = _long(list(chain.from_iterable(token_ids)), counts)
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    return counts


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: temperature-scaled [rows, vocab]; min_p: [rows], 0 = off."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
