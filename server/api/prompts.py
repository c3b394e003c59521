"""Prompts made ready on the API side, before the engine thread sees them: text longer
than max_model_len tokens could ever cover is refused without tokenizing it, and the
chat template and the tokenizer run on one dedicated thread, off the event loop (a long
prompt would stall every other connection) and off the engine thread (it would stall
every running sequence). The engine gets token ids (vLLM's TokensPrompt), with the text
kept for echo."""

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from batchpilot.server.api.errors import APIError

# One thread: a fast tokenizer is not meant to be driven from several threads at once,
# and one core is as much as tokenizing may take from the engine.
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")


async def off_loop(fn, *args):
    """fn(*args) on the tokenizer thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_TOKENIZER_THREAD, functools.partial(fn, *args))


@functools.cache
def longest_token_chars(tokenizer) -> int:
    """The longest token string in the vocabulary. A token decodes to at most that many
    characters: byte-level BPE writes each byte of a token as one character of its string,
    SentencePiece each character (byte fallback <0xNN> as six)."""
    return max(len(token) for token in tokenizer.get_vocab())


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Text longer than this tokenizes to more than max_model_len tokens, so it can be
    refused untokenized: each token covers at most longest_token_chars characters (81 for
    SmolLM2, whose longest is a newline and 80 spaces; a prompt of dashes averages 64).
    A normalizer that composes characters (NFC) could shrink a text below that, but only
    text made of combining sequences, which no long token spells."""
    return max_model_len * longest_token_chars(tokenizer)


def check_chars(tokenizer, max_model_len: int, num_chars: int, param: str) -> None:
    limit = max_prompt_chars(tokenizer, max_model_len)
    if num_chars > limit:
        raise APIError(400, f"The prompt has {num_chars} characters, more than the "
                       f"{max_model_len} tokens of this model's context can hold (at most "
                       f"{limit} characters). Please reduce the length of the input.",
                       param)  # fmt: skip


def check_tokens(num_tokens: int, max_model_len: int) -> None:
    if num_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your request has {num_tokens} input tokens. Please reduce "
                       "the length of the input messages.", "prompt")  # fmt: skip


async def completion_prompts(tokenizer, max_model_len: int,
                             prompts: list[str | list[int]]) -> list[dict]:  # fmt: skip
    """/v1/completions' prompts as TokensPrompts, tokenized off the loop."""
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        check_chars(tokenizer, max_model_len, len(text), "prompt")
    for ids in prompts:
        if not isinstance(ids, str):
            check_tokens(len(ids), max_model_len)
    tokenized = iter(await off_loop(_tokenize_all, tokenizer, texts) if texts else ())
    return [{"prompt_token_ids": next(tokenized), "prompt": p} if isinstance(p, str)
            else {"prompt_token_ids": p} for p in prompts]  # fmt: skip


def _tokenize_all(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in texts]


def check_messages(tokenizer, max_model_len: int, messages: list) -> None:
    """The messages' text alone must fit: the template only adds to it."""
    num_chars = sum(len(m.text()) for m in messages)
    check_chars(tokenizer, max_model_len, num_chars, "messages")
