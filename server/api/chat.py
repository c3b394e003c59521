"""POST /v1/chat/completions: the model's chat template turns messages into a prompt."""

import time

from fastapi import APIRouter, Depends, Request, Response

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import (
    AbortingStreamingResponse,
    check_model,
    collect,
    require_engine,
    start,
    stream_error_event,
)
from batchpilot.server.api.protocol import ChatCompletionRequest, sampling_params
from batchpilot.server.async_engine import RequestStream

router = APIRouter()

KIND = "chat.completion.chunk"


def render_prompt(tokenizer, body: ChatCompletionRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(
            body.template_messages(),
            add_generation_prompt=body.add_generation_prompt,
            tokenize=True,
        )
    except Exception as e:  # a template can reject a conversation (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {e}", "messages") from e
    # Newer transformers return a BatchEncoding here.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 ctx: ServerContext = Depends(get_context)):  # fmt: skip
    model = check_model(ctx, body.model)
    require_engine(ctx)
    prompt = render_prompt(ctx.engine.tokenizer, body)
    # Without a limit a chat answer may use the rest of the context, as in vLLM.
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, ctx.engine.config.max_model_len - len(prompt))
    base_id = r.new_id("chatcmpl")
    requests = [(f"{base_id}-{i}", prompt, sampling_params(body, max_tokens, i))
                for i in range(body.n)]  # fmt: skip
    stream = await start(ctx, requests)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    created = int(time.time())
    if body.stream:
        events = _events(stream, index, base_id, model, created, body.include_usage)
        return AbortingStreamingResponse(events, stream)
    final = await collect(stream, request.receive)
    if final is None:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    outs = sorted(final.values(), key=lambda o: index[o.request_id])
    choices = [r.chat_choice(index[o.request_id], o.outputs[0].text, o.outputs[0].finish_reason)
               for o in outs]  # fmt: skip
    return r.chat_body(base_id, model, choices, _usage(outs), created)


def _usage(outs: list) -> dict:
    # n choices share one prompt, counted once.
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return r.usage(len(outs[0].prompt_token_ids) if outs else 0, completion)


async def _events(stream: RequestStream, index: dict, base_id: str, model: str, created: int,
                  include_usage: bool):  # fmt: skip
    def event(choices, usage=None):
        return r.sse(r.chunk(KIND, base_id, model, created, choices, usage, include_usage))

    yield "".join(event([r.chat_delta_choice(i, {"role": "assistant", "content": ""}, None)])
                  for i in index.values())  # fmt: skip
    latest: dict = {}
    try:
        async for outs in stream:
            parts = []
            for out in outs:
                latest[out.request_id] = out
                c = out.outputs[0]
                if c.delta_text or out.finished:
                    delta = {"content": c.delta_text} if c.delta_text else {}
                    choice = r.chat_delta_choice(index[out.request_id], delta, c.finish_reason)
                    parts.append(event([choice]))
            if parts:
                yield "".join(parts)  # one write per step
    except Exception as e:
        yield stream_error_event(e)
    else:
        if include_usage:
            yield event([], _usage(list(latest.values())))
    yield r.DONE
