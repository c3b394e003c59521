"""Batched sampling in vLLM's order. The logprobs a request asked for are taken first,
from the raw logits (vLLM's default logprobs_mode, "raw_logprobs"); then the logits
processors that can change a greedy choice (min_tokens, logit_bias, penalties) apply to
every row, greedy rows take the argmax, and the others go through temperature, min_p,
top-k and top-p before a draw. Each seeded request draws from its own generator, so its
output does not depend on what else is in the batch.

logprobs_mode "processed_logprobs" reports the distribution actually sampled from
instead: after the processors, and for non-greedy rows after temperature, min_p, top-k
and top-p, as vLLM's mode of that name does."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.sampling.logprobs import PositionLogprobs, compute_logprobs, gather_logprobs
from batchpilot.server.sampling.penalties import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
)

logger = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    token_ids: list[int | None]  # None only for a row in faults
    logprobs: list[PositionLogprobs | None]  # per row; None where not asked for
    faults: dict[int, Exception] = field(default_factory=dict)  # row -> what its sampling raised


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


def sample(logits: torch.Tensor, seqs: list[Sequence],
           logprobs_mode: str = "raw_logprobs") -> SamplerOutput:  # fmt: skip
    """logits: [rows, vocab] float32, one row per sequence that samples this step."""
    params = [s.params for s in seqs]
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = compute_logprobs(logits[wanted]) if wanted and logprobs_mode == "raw_logprobs" else None
    _apply_processors(logits, seqs)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = _sampling_distribution(logits[rows], [params[i] for i in rows])
        tokens[rows] = _draw(sub.softmax(dim=-1), [seqs[i].generator for i in rows])
        logits[rows] = sub
    if not wanted:
        return SamplerOutput(tokens.tolist(), [None] * len(seqs))
    source = raw if raw is not None else compute_logprobs(logits[wanted])
    gathered = gather_logprobs(source, tokens[wanted], [params[i].logprobs for i in wanted])
    logprobs: list[PositionLogprobs | None] = [None] * len(seqs)
    for i, position in zip(wanted, gathered, strict=True):
        logprobs[i] = position
    return SamplerOutput(tokens.tolist(), logprobs)


def sample_isolating_faults(logits: torch.Tensor, seqs: list[Sequence], logprobs_mode: str,
                            recompute: Callable[[], torch.Tensor]) -> SamplerOutput:  # fmt: skip
    """sample(), except that when the batch raises, the rows whose sampling alone raises
    are failed (faults) and the others are sampled as the batch would have sampled them.
    recompute() gives the logits again: sample() has changed them in place by then. Until
    a batch raises, the only cost is saving the generator states of the seeded rows that
    draw, which a batch that raised may have advanced."""
    seeded = [(s.generator, s.generator.get_state()) for s in seqs
              if s.params.seed is not None and not s.params.greedy]  # fmt: skip
    try:
        return sample(logits, seqs, logprobs_mode)
    except Exception:
        logger.exception("sampling a batch of %d sequences failed; sampling each alone",
                         len(seqs))  # fmt: skip
    for generator, state in seeded:
        generator.set_state(state)
    fresh = recompute()
    out = SamplerOutput([None] * len(seqs), [None] * len(seqs))
    for i, seq in enumerate(seqs):
        try:
            row = sample(fresh[i : i + 1], [seq], logprobs_mode)
        except Exception as error:
            logger.exception("sampling request %s failed; failing it alone", seq.request_id)
            out.faults[i] = error
            continue
        out.token_ids[i], out.logprobs[i] = row.token_ids[0], row.logprobs[0]
    return out


def _apply_processors(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """The argmax-changing processors, in place: min_tokens, logit_bias, penalties."""
    params = [s.params for s in seqs]
    apply_min_tokens(logits, [p.all_stop_token_ids if s.num_output_tokens < p.min_tokens
                              else () for s, p in zip(seqs, params, strict=True)])  # fmt: skip
    apply_logit_bias(logits, [p.logit_bias for p in params])
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if rows:
        apply_penalties(
            logits,
            rows,
            [seqs[i].prompt_token_ids for i in rows],
            [seqs[i].output_token_ids for i in rows],
            [params[i].presence_penalty for i in rows],
            [params[i].frequency_penalty for i in rows],
            [params[i].repetition_penalty for i in rows],
        )


def _sampling_distribution(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then min_p, then top-k and top-p: the logits a row draws from."""
    device = logits.device
    column = lambda name: torch.tensor([getattr(p, name) for p in params], device=device)  # noqa: E731
    logits = logits / column("temperature")[:, None]
    min_p = column("min_p")
    if (min_p > 0).any():
        logits = apply_min_p(logits, min_p)
    top_k, top_p = column("top_k"), column("top_p")
    if (top_k > 0).any() or (top_p < 1.0).any():
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    return logits


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Inverse CDF: one uniform per row from the row's own generator, then one batched
    cumsum and search. Noise over the whole vocabulary per row (the exponential race)
    cost about 1 ms a row on a CPU, a third of a 40-sequence step."""
    u = torch.cat([torch.rand(1, generator=g, device=probs.device, dtype=torch.float64)
                   for g in generators])  # fmt: skip
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    # right=True: the first token whose cumulative mass exceeds the draw, so a token
    # with zero probability (filtered out) is never the answer.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[-1] - 1)
