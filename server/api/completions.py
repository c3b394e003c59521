"""POST /v1/completions."""

import time

from fastapi import APIRouter, Depends, Request, Response

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.generation import (
    AbortingStreamingResponse,
    check_model,
    collect,
    require_engine,
    start,
    stream_error_event,
)
from batchpilot.server.api.protocol import CompletionRequest, sampling_params
from batchpilot.server.async_engine import RequestStream

router = APIRouter()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            ctx: ServerContext = Depends(get_context)):  # fmt: skip
    model = check_model(ctx, body.model)
    require_engine(ctx)
    prompts = body.prompts()
    max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    base_id = r.new_id("cmpl")
    # Choice index = prompt index * n + sample index, as OpenAI numbers a batch.
    requests = [
        (f"{base_id}-{p * body.n + i}", prompt, sampling_params(body, max_tokens, i))
        for p, prompt in enumerate(prompts)
        for i in range(body.n)
    ]
    stream = await start(ctx, requests)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    created = int(time.time())
    if body.stream:
        events = _events(stream, index, base_id, model, created, body.include_usage, body.n)
        return AbortingStreamingResponse(events, stream)
    final = await collect(stream, request.receive)
    if final is None:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    outs = sorted(final.values(), key=lambda o: index[o.request_id])
    choices = [r.completion_choice(index[o.request_id], o.outputs[0].text,
                                   o.outputs[0].finish_reason) for o in outs]  # fmt: skip
    return r.completion_body(base_id, model, choices, _usage(outs, index, body.n), created)


def _usage(outs: list, index: dict, n: int) -> dict:
    # Each prompt counts once however many choices it has, as OpenAI bills it.
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs if index[o.request_id] % n == 0)
    return r.usage(prompt_tokens, sum(len(o.outputs[0].token_ids) for o in outs))


async def _events(stream: RequestStream, index: dict, base_id: str, model: str, created: int,
                  include_usage: bool, n: int):  # fmt: skip
    latest: dict = {}
    try:
        async for outs in stream:
            parts = []
            for out in outs:
                latest[out.request_id] = out
                c = out.outputs[0]
                if c.delta_text or out.finished:
                    choice = r.completion_choice(index[out.request_id], c.delta_text,
                                                 c.finish_reason)  # fmt: skip
                    body = r.chunk("text_completion", base_id, model, created, [choice],
                                   with_usage_field=include_usage)  # fmt: skip
                    parts.append(r.sse(body))
            if parts:
                yield "".join(parts)  # one write per step
    except Exception as e:
        yield stream_error_event(e)
    else:
        if include_usage:
            usage = _usage(list(latest.values()), index, n)
            yield r.sse(r.chunk("text_completion", base_id, model, created, [], usage))
    yield r.DONE
