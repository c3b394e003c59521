"""EngineClient: what the API layer asks of the engine it serves from, whether the engine
runs on a thread of the server's process (async_engine.AsyncEngine) or in a process of
its own (engine_process.EngineProcessClient). Everything here is used on the event loop.

Also the stream a submission hands back and the errors the API maps to status codes."""

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.stats import EngineStats


class EngineNotReady(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """The engine failed this request (a step serving it raised) and went on serving."""


@runtime_checkable
class EngineClient(Protocol):
    loaded: asyncio.Future | None  # resolves when the engine has loaded (or failed to)
    stats: EngineStats | None  # after the latest step; None until loaded
    config: EngineConfig | None  # the engine's resolved config, once loaded
    tokenizer: Any
    failure: BaseException | None  # what ended the engine, if it ended

    @property
    def is_loaded(self) -> bool: ...

    @property
    def num_waiting(self) -> int:
        """Requests not yet running, those handed over and not yet taken included."""
        ...

    def start(self) -> None:
        """Start loading the engine; on the running event loop."""

    async def submit(self, requests: list[tuple[str, Any, Any]], lora_name: str | None = None
                     ) -> "RequestStream":  # fmt: skip
        """requests: (request_id, prompt or token ids, SamplingParams), all for the LoRA
        adapter lora_name (None: the base model). Returns once the engine accepted them
        all; raises the engine's rejection (RequestRejected, a ValueError) if it refused
        any, in which case none of them runs."""
        ...

    def abort(self, request_ids: list[str]) -> None: ...

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) between two steps, where the engine runs; its result. fn must pickle
        (a module-level function or a functools.partial of one) to reach an engine process."""
        ...

    async def shutdown(self) -> None:
        """Abort whatever still runs and stop the engine."""


class RequestStream:
    """The engine requests of one HTTP request (n choices, or a batch of prompts).

    Iterating yields the RequestOutputs these requests produced since the last read, until
    all have finished. Outputs a reader has not taken yet coalesce: at most the newest one
    per request is held (its delta covers every step since the last read), so a client that
    stops reading pins O(output length) per choice, not one copy of the text per step.
    `close()` aborts whatever is unfinished: call it when the client goes away.
    """

    def __init__(self, owner: EngineClient, request_ids: list[str]):
        self.request_ids = request_ids
        self._owner = owner
        self._pending: dict[str, Any] = {}  # request id -> newest unread RequestOutput
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._unfinished = set(request_ids)
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()

    def __aiter__(self):
        return self

    async def __anext__(self) -> list:
        if not self._unfinished:
            raise StopAsyncIteration
        await self._ready.wait()
        if not self._pending:  # only an error is left to hand over
            self._unfinished.clear()
            raise self._error
        outs = list(self._pending.values())
        self._pending.clear()
        if self._error is None:
            self._ready.clear()
        for out in outs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        return outs

    def put(self, outs: list) -> None:
        """Hand over one step's outputs (event loop only)."""
        for out in outs:
            earlier = self._pending.get(out.request_id)
            self._pending[out.request_id] = out if earlier is None else _coalesce(earlier, out)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with error, after the outputs already handed over."""
        self._error = error
        self._ready.set()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def close(self) -> None:
        if self._unfinished:
            self._owner.abort(sorted(self._unfinished))
            self._unfinished.clear()


def _coalesce(earlier, later):
    """later, with the deltas of earlier (which no reader took) in front of its own."""
    a, b = earlier.outputs[0], later.outputs[0]
    b.delta_text = a.delta_text + b.delta_text
    b.delta_token_ids = a.delta_token_ids + b.delta_token_ids
    return later
