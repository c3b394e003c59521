"""Batched sampling: greedy, temperature, top-k and top-p. Each seeded request draws
from its own generator, so its output does not depend on what else is in the batch."""

import torch

from batchpilot.server.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """logits: [rows, vocab] float32 -> one token id per row."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows]
        device = logits.device
        temps = torch.tensor([params[i].temperature for i in rows], device=device)
        top_k = torch.tensor([params[i].top_k for i in rows], device=device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=device)
        sub = sub / temps[:, None]
        if (top_k > 0).any() or (top_p < 1.0).any():
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.stack(
            [
                torch.empty(probs.shape[-1], device=device).exponential_(generator=generators[i])
                for i in rows
            ]
        )
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()
