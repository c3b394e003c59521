"""Logprobs in OpenAI's two response shapes, from the engine's per-position dicts
(token id -> Logprob, the scored token plus the top N).

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, where each
top_logprobs entry maps token text -> logprob for the top N plus the scored token, and a
position with nothing to score (the first prompt token under echo) is null. Chat:
{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}, the top N by rank.

Token text is each token decoded on its own, as vLLM reports it. JSON has no -inf, so a
logprob below -9999 is reported as -9999, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # server/sampling/logprobs.py imports torch; the API must load without it
    from batchpilot.server.sampling.logprobs import PositionLogprobs

FLOOR = -9999.0


def completion_logprobs(tokenizer, token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None], text_offset: int = 0) -> dict:  # fmt: skip
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if p is None else _value(p[t].logprob)
            for t, p in zip(token_ids, positions, strict=True)
        ],
        "top_logprobs": [None if p is None else _top_texts(tokenizer, p) for p in positions],
        "text_offset": offsets,
    }


def _top_texts(tokenizer, position: PositionLogprobs) -> dict[str, float]:
    return {tokenizer.decode([t]): _value(lp.logprob) for t, lp in position.items()}


def chat_logprobs(tokenizer, token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
                  top_logprobs: int) -> dict:  # fmt: skip
    content = []
    for token, position in zip(token_ids, positions, strict=True):
        ranked = sorted((lp.rank, t) for t, lp in position.items() if lp.rank <= top_logprobs)
        entry = _chat_entry(tokenizer, token, position[token].logprob)
        entry["top_logprobs"] = [_chat_entry(tokenizer, t, position[t].logprob)
                                 for _, t in ranked[:top_logprobs]]  # fmt: skip
        content.append(entry)
    return {"content": content}


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)
