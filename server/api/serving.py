"""The one handler skeleton behind /v1/completions and /v1/chat/completions. A route
builds its prompts and max_tokens; `respond` submits one engine request per prompt and
choice, then answers with a whole body or an SSE stream. The routes differ only in an
Endpoint: the object names and how a choice looks."""

import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.generation import (
    AbortingStreamingResponse,
    collect,
    start,
    stream_error_event,
)
from batchpilot.server.api.protocol import sampling_params
from batchpilot.server.async_engine import RequestStream

Choice = Callable[[int, str, str | None], dict]  # (index, text, finish_reason) -> choice


@dataclass(frozen=True)
class Endpoint:
    id_prefix: str
    kind: str  # the whole body's "object"
    chunk_kind: str  # a streamed chunk's "object"
    choice: Choice  # a choice of the whole body
    delta_choice: Choice  # a streamed choice: text is the new text only
    opening: Callable[[int], dict] | None = None  # the first streamed choice, per index


@dataclass
class Reply:
    """One response being built: its ids, model and how the choices are numbered."""

    endpoint: Endpoint
    base_id: str
    model: str
    created: int
    index: dict[str, int]  # engine request id -> choice index
    n: int
    include_usage: bool


async def respond(ctx: ServerContext, request: Request, body, endpoint: Endpoint, model: str,
                  prompts: list, max_tokens: int):  # fmt: skip
    base_id = r.new_id(endpoint.id_prefix)
    # Choice index = prompt index * n + sample index, as OpenAI numbers a batch.
    requests = [
        (f"{base_id}-{p * body.n + i}", prompt, sampling_params(body, max_tokens, i))
        for p, prompt in enumerate(prompts)
        for i in range(body.n)
    ]
    stream = await start(ctx, requests)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    reply = Reply(endpoint, base_id, model, int(time.time()), index, body.n, body.include_usage)
    if body.stream:
        return AbortingStreamingResponse(_events(stream, reply), stream)
    final = await collect(stream, request.receive)
    if final is None:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    outs = sorted(final.values(), key=lambda o: index[o.request_id])
    choices = [endpoint.choice(index[o.request_id], o.outputs[0].text, o.outputs[0].finish_reason)
               for o in outs]  # fmt: skip
    return r.body(endpoint.kind, base_id, model, choices, _usage(outs, reply), reply.created)


def _usage(outs: list, reply: Reply) -> dict:
    # Each prompt counts once however many choices it has, as OpenAI bills it.
    prompt_tokens = sum(
        len(o.prompt_token_ids) for o in outs if reply.index[o.request_id] % reply.n == 0
    )
    return r.usage(prompt_tokens, sum(len(o.outputs[0].token_ids) for o in outs))


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
                c = out.outputs[0]
                if c.delta_text or out.finished:
                    i = reply.index[out.request_id]
                    parts.append(event([reply.endpoint.delta_choice(i, c.delta_text,
                                                                    c.finish_reason)]))  # fmt: skip
            if parts:
                yield "".join(parts)  # one write per step
    except Exception as e:
        yield stream_error_event(e)
    else:
        if reply.include_usage:
            yield event([], _usage(list(latest.values()), reply))
    yield r.DONE
