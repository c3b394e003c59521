"""Arrival processes: who asks for how many tokens, and when."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Prompt and output lengths of a chat-like mix (tokens), drawn uniformly.
CHAT_PROMPTS = (32, 64, 128, 256)
CHAT_OUTPUTS = (32, 64, 128, 256)
# Retrieval-style requests: long prompts, short answers, so prefill dominates.
SHORT_OUTPUTS = (16, 32, 64)


@dataclass(frozen=True)
class Request:
    arrival: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Poisson arrivals at ``rate(t)`` per second (thinned against ``peak``); with
    ``burstiness`` < 1, gamma gaps of that shape instead (vllm bench serve's knob), so the
    same mean rate comes in clumps."""

    rate: Callable[[float], float]
    peak: float
    prompt_lens: tuple[int, ...] = CHAT_PROMPTS
    output_lens: tuple[int, ...] = CHAT_OUTPUTS
    burstiness: float = 1.0

    def requests(self, duration: float, seed: int = 0) -> Iterator[Request]:
        rng = random.Random(seed)
        t = 0.0
        while True:
            t += rng.gammavariate(self.burstiness, 1.0 / (self.burstiness * self.peak))
            if t >= duration:
                return
            if rng.random() * self.peak <= self.rate(t):
                yield Request(t, rng.choice(self.prompt_lens), rng.choice(self.output_lens))


def steady(rate: float, **kw) -> Workload:
    return Workload(lambda t: rate, rate, **kw)


def step_load(before: float, after: float, at: float, **kw) -> Workload:
    return Workload(lambda t: before if t < at else after, max(before, after), **kw)


def diurnal(mean: float, amplitude: float, period: float, **kw) -> Workload:
    """A day compressed into ``period`` seconds: mean ± amplitude, lowest at t = 0."""
    return Workload(
        lambda t: mean - amplitude * math.cos(2 * math.pi * t / period), mean + amplitude, **kw
    )


def bursty(rate: float, burstiness: float = 0.25, **kw) -> Workload:
    return Workload(lambda t: rate, rate, burstiness=burstiness, **kw)


def heavy_prefill(rate: float, prompt_lens: tuple[int, ...]) -> Workload:
    return steady(rate, prompt_lens=prompt_lens, output_lens=SHORT_OUTPUTS)
