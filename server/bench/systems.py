"""What one offline system run produced, in the units the comparison table uses."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class SystemRun:
    name: str
    num_requests: int
    computed_tokens: int  # output tokens the system generated, padding rows included
    useful_tokens: int  # tokens the requests asked for
    seconds: float
    note: str = ""
    round_useful_tok_s: list[float] = field(default_factory=list)  # every round, when repeated

    @property
    def output_tok_s(self) -> float:
        return self.computed_tokens / self.seconds

    @property
    def useful_tok_s(self) -> float:
        return self.useful_tokens / self.seconds

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "computed_tokens": self.computed_tokens,
            "useful_tokens": self.useful_tokens,
            "seconds": self.seconds,
            "output_tok_s": self.output_tok_s,
            "useful_tok_s": self.useful_tok_s,
            "note": self.note,
            "round_useful_tok_s": self.round_useful_tok_s,
        }
