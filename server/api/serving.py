"""The one handler skeleton behind /v1/completions and /v1/chat/completions. A route
builds its prompts and max_tokens; `respond` submits one engine request per prompt and
choice, then answers with a whole body or an SSE stream. The routes differ only in an
Endpoint: the object names, how a choice looks and how its logprobs are shaped."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request, Response

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.generation import collect, start, stream_error_event
from batchpilot.server.api.protocol import sampling_params
from batchpilot.server.api.streaming import AbortingStreamingResponse
from batchpilot.server.engine.client import RequestStream

# (index, text, finish_reason, logprobs, stop_reason) -> choice
Choice = Callable[[int, str, str | None, dict | None, int | str | None], dict]


@dataclass(frozen=True)
class Endpoint:
    id_prefix: str
    kind: str  # the whole body's "object"
    chunk_kind: str  # a streamed chunk's "object"
    choice: Choice  # a choice of the whole body
    delta_choice: Choice  # a streamed choice: text and logprobs of the new tokens only
    # (reply, token ids, their logprobs, text offset of the first) -> the logprobs object
    logprobs: Callable[["Reply", list[int], list, int], dict]
    opening: Callable[[int], dict] | None = None  # the first streamed choice, per index


@dataclass
class Reply:
    """One response being built: its ids, model, how the choices are numbered, and what
    the request asked to see besides the text."""

    endpoint: Endpoint
    base_id: str
    model: str
    created: int
    index: dict[str, int]  # engine request id -> choice index
    n: int
    include_usage: bool
    body: object  # the request body
    tokenizer: object
    echo: bool = False  # completions: the prompt comes first
    echo_only: bool = False  # completions with max_tokens 0: only the prompt
    sent_chars: dict[str, int] = field(default_factory=dict)  # streamed text per request

    @property
    def wants_logprobs(self) -> bool:
        return self.body.logprobs_params()[0] is not None


async def respond(ctx: ServerContext, request: Request, body, endpoint: Endpoint, model: str,
                  prompts: list, max_tokens: int, echo: bool = False,
                  lora_name: str | None = None):  # fmt: skip
    base_id = r.new_id(endpoint.id_prefix)
    # Choice index = prompt index * n + sample index, as OpenAI numbers a batch. With
    # max_tokens 0 one token is generated and dropped, as vLLM does.
    requests = [
        (f"{base_id}-{p * body.n + i}", prompt, sampling_params(body, max(1, max_tokens), i))
        for p, prompt in enumerate(prompts)
        for i in range(body.n)
    ]
    stream = await start(ctx, requests, lora_name)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    reply = Reply(endpoint, base_id, model, int(time.time()), index, body.n, body.include_usage,
                  body, ctx.engine.tokenizer, echo, echo and max_tokens == 0)  # fmt: skip
    if body.stream:
        return AbortingStreamingResponse(_events(stream, reply), stream, ctx.stream_stall_timeout)
    final = await collect(stream, request.receive)
    if final is None:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    outs = sorted(final.values(), key=lambda o: index[o.request_id])
    choices = [_whole_choice(reply, o) for o in outs]
    return r.body(endpoint.kind, base_id, model, choices, _usage(outs, reply), reply.created)


def _whole_choice(reply: Reply, out) -> dict:
    c = out.outputs[0]
    text, token_ids, positions = _generated(reply, c.text, c.token_ids, c.logprobs or [])
    if reply.echo:
        text, token_ids, positions = _with_prompt(reply, out, text, token_ids, positions)
    logprobs = (
        reply.endpoint.logprobs(reply, token_ids, positions, 0) if reply.wants_logprobs else None
    )
    return reply.endpoint.choice(reply.index[out.request_id], text, c.finish_reason, logprobs,
                                 c.stop_reason)  # fmt: skip


def _delta_choice(reply: Reply, out) -> dict | None:
    """The streamed choice for out's new tokens, or None when there is nothing to send:
    text held back (a stop string may be starting) still sends its tokens' logprobs."""
    c = out.outputs[0]
    n, k = len(c.token_ids), len(c.delta_token_ids)
    new_logprobs = c.logprobs[n - k : n] if c.logprobs is not None else []
    text, token_ids, positions = _generated(reply, c.delta_text, c.delta_token_ids, new_logprobs)
    first = out.request_id not in reply.sent_chars
    if first and reply.echo:
        text, token_ids, positions = _with_prompt(reply, out, text, token_ids, positions)
    offset = reply.sent_chars.get(out.request_id, 0)
    reply.sent_chars[out.request_id] = offset + len(text)
    logprobs = None
    if reply.wants_logprobs and token_ids:
        logprobs = reply.endpoint.logprobs(reply, token_ids, positions, offset)
    if not (text or logprobs or out.finished):
        return None
    return reply.endpoint.delta_choice(reply.index[out.request_id], text, c.finish_reason,
                                       logprobs, c.stop_reason)  # fmt: skip


def _generated(reply: Reply, text: str, token_ids: list[int], positions: list):
    return ("", [], []) if reply.echo_only else (text, list(token_ids), list(positions))


def _with_prompt(reply: Reply, out, text: str, token_ids: list[int], positions: list):
    prompt = out.prompt if out.prompt is not None else reply.tokenizer.decode(out.prompt_token_ids)
    prompt_positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return prompt + text, out.prompt_token_ids + token_ids, prompt_positions + positions


def _usage(outs: list, reply: Reply) -> dict:
    # Each prompt counts once however many choices it has, as OpenAI bills it.
    prompt_tokens = sum(
        len(o.prompt_token_ids) for o in outs if reply.index[o.request_id] % reply.n == 0
    )
    generated = 0 if reply.echo_only else sum(len(o.outputs[0].token_ids) for o in outs)
    return r.usage(prompt_tokens, generated)


async def _events(stream: RequestStream, reply: Reply):
    def event(choices: list[dict], usage: dict | None = None) -> str:
        return r.sse(r.chunk(reply.endpoint.chunk_kind, reply.base_id, reply.model,
                             reply.created, choices, usage, reply.include_usage))  # fmt: skip

    if reply.endpoint.opening is not None:
        yield "".join(event([reply.endpoint.opening(i)]) for i in reply.index.values())
    latest: dict = {}
    try:
        async for outs in stream:
            parts = []
            for out in outs:
                latest[out.request_id] = out
                choice = _delta_choice(reply, out)
                if choice is not None:
                    parts.append(event([choice]))
            if parts:
                yield "".join(parts)  # one write per step
    except Exception as e:
        yield stream_error_event(e)
    else:
        if reply.include_usage:
            yield event([], _usage(list(latest.values()), reply))
    yield r.DONE
