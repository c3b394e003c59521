"""SamplingParams, shaped like vLLM's: the same field names, defaults and bounds."""

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs, and OpenAI's bound on top_logprobs


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-N logprobs per sampled token (the token's own always)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # stop_token_ids plus EOS unless ignore_eos: what min_tokens holds back. The engine
    # fills in EOS (update_from_eos), as vLLM's update_from_generation_config does.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        self.all_stop_token_ids = set(self.stop_token_ids)
        self.validate()

    def update_from_eos(self, eos_token_ids: set[int]) -> None:
        if not self.ignore_eos:
            self.all_stop_token_ids |= eos_token_ids

    def validate(self) -> None:
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _checks(self):
        # NaN passes no comparison but inf passes one-sided bounds, and either poisons a
        # whole row of logits.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            yield math.isfinite(value), f"{name} must be a finite number, got {value}"
        yield (all(math.isfinite(b) for b in (self.logit_bias or {}).values()),
               "logit_bias values must be finite numbers")  # fmt: skip
        yield (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}")  # fmt: skip
        yield self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"
        yield 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"
        yield (self.top_k == -1 or self.top_k >= 1,
               f"top_k must be -1 (disable) or at least 1, got {self.top_k}")  # fmt: skip
        yield 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"
        yield self.n >= 1, f"n must be at least 1, got {self.n}"
        yield all(s for s in self.stop_strings), "stop strings must be non-empty"
        yield (0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            yield -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}"
        yield (self.repetition_penalty > 0.0,
               f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            yield (value is None or 0 <= value <= MAX_LOGPROBS,
                   f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")  # fmt: skip

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)  # fmt: skip
