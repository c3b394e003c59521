"""OpenAI request bodies for /v1/completions and /v1/chat/completions, and their mapping to
SamplingParams.

Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working. Fields
that would change the result but that this server does not implement are rejected with a
400 instead of being silently ignored.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batchpilot.server.api.errors import APIError

# Bounds that keep a single request from asking for absurd work; the 413 body limit and
# max_model_len bound the rest (docs/api.md, "Security and bounds").
MAX_N = 128  # OpenAI's bound on n
# Engine sequences one request may start (prompts x n): each is a queue slot and, once
# running, a batch slot and KV blocks. OpenAI caps n at 128 and a prompt batch at 2048
# strings; their product would let one request fill --max-queue-len many times over.
MAX_SEQS_PER_REQUEST = 256
MAX_STOP_SEQUENCES = 16
# Every stop string is searched in the text at every step, and streaming holds back its
# length in characters; a longer stop string is no sensible use.
MAX_STOP_STRING_CHARS = 512
# Each entry costs one indexed add per row per step; 300 is plenty to ban a word list.
MAX_LOGIT_BIAS_ENTRIES = 300
INT64_MAX = (1 << 63) - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI allows 20 top_logprobs in chat

PositiveInt = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. vLLM's extensions (top_k, ignore_eos,
    stop_token_ids, repetition_penalty, min_p, min_tokens, prompt_logprobs) are accepted at
    the top level, as the openai client's extra_body sends them. Python's json accepts
    NaN and Infinity, so every float is checked finite (allow_inf_nan=False).

    Every list a body can make long is fail_fast, and the long ones are measured before
    their items are validated: pydantic otherwise reports one error per bad item (and per
    union member), seconds of event-loop time for a 4 MiB body."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None  # the engine: <= vocab
    seed: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    stop: (
        StopString
        | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES, fail_fast=True)]
        | None
    ) = None
    stop_token_ids: (
        Annotated[list[TokenId], Field(max_length=MAX_STOP_SEQUENCES, fail_fast=True)] | None
    ) = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bound_logit_bias(cls, biases):
        if isinstance(biases, dict) and len(biases) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(biases)}")  # fmt: skip
        return biases

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
        for key in self.logit_bias or ():
            if not key.lstrip("-").isdecimal():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return self

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with int keys, each bias clamped to [-100, 100] as OpenAI does."""
        if not self.logit_bias:
            return None
        return {int(k): min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists: one
    # prompt or a batch, as OpenAI defines it.
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_SEQS_PER_REQUEST, fail_fast=True)]
        | Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]],
            Field(min_length=1, max_length=MAX_SEQS_PER_REQUEST, fail_fast=True),
        ]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 only with echo
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bound_batch(cls, prompt):
        # Before pydantic validates a million [1] as a list of prompts to refuse it after.
        is_batch = isinstance(prompt, list) and not all(isinstance(x, int) for x in prompt)
        if is_batch and len(prompt) > MAX_SEQS_PER_REQUEST:
            raise ValueError(f"a prompt batch holds at most {MAX_SEQS_PER_REQUEST} prompts, "
                             f"got {len(prompt)}")  # fmt: skip
        return prompt

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server; use n")
        sequences = len(self.prompts()) * self.n
        if sequences > MAX_SEQS_PER_REQUEST:
            raise ValueError(f"{len(self.prompts())} prompt(s) x n={self.n} asks for {sequences} "
                             f"sequences; one request may ask for at most {MAX_SEQS_PER_REQUEST}")  # fmt: skip
        return self

    def logprobs_params(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs): echo with logprobs scores the prompt too, as vLLM."""
        prompt = self.prompt_logprobs
        if prompt is None and self.echo:
            prompt = self.logprobs
        return self.logprobs, prompt

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        return self

    def logprobs_params(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the engine."""
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def sampling_params(request: SamplingFields, max_tokens: int, index: int):
    """The SamplingParams for choice `index` of `request`. With a seed, choice i uses
    seed + i so that n choices differ but each stays reproducible."""
    from batchpilot.server.sampling.sampling_params import SamplingParams

    seed = None if request.seed is None else (request.seed + index) % (INT64_MAX + 1)
    logprobs, prompt_logprobs = request.logprobs_params()
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k is None else request.top_k,
            seed=seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            min_p=request.min_p or 0.0,
            min_tokens=request.min_tokens,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=request.repetition_penalty or 1.0,
            logit_bias=request.token_biases(),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from e
