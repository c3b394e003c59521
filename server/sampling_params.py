"""SamplingParams, shaped like vLLM's."""

from dataclasses import dataclass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        checks = [
            (
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k == -1 or self.top_k >= 1,
                f"top_k must be -1 (disable) or at least 1, got {self.top_k}",
            ),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (all(s for s in self.stop_strings), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
