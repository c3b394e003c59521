"""What one offline system run produced, in the units the comparison table uses."""

from dataclasses import dataclass


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
        }
