"""AsyncEngine: the LLMEngine behind asyncio, for the HTTP server.

The engine is not thread-safe, so exactly one thread (started here) builds it and calls
it. The event loop only appends to hand-off lists under a lock; the engine thread drains
them between steps, runs one turn (engine_core), and hands everything that step produced
back with a single `loop.call_soon_threadsafe` -- once per step, not per token, so the
event loop does not fight the engine thread for the GIL on every token, and a model step
never blocks the event loop.

With process=True the engine runs in a process of its own instead (engine_process, as
vLLM v1's EngineCore): the same turns, fed and read through a pipe, so the engine and the
HTTP side never take the GIL from each other.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.server.engine_core import EngineCore, Turn
from batchpilot.server.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """The engine failed this request (a step serving it raised) and went on serving."""


@dataclass
class StepResult:
    """One turn of the engine, delivered to the loop at once, with its admissions and call
    results matched back to their streams and futures (which never leave the loop's side)."""

    turn: Turn
    admissions: list  # (RequestStream, exception or None)
    call_results: list  # (future, result, exception or None)
    config: Any = None  # the engine's config after this turn's calls (engine process only)


class RequestStream:
    """The engine requests of one HTTP request (n choices, or a batch of prompts).

    Iterating yields the RequestOutputs these requests produced since the last read, until
    all have finished. Outputs a reader has not taken yet coalesce: at most the newest one
    per request is held (its delta covers every step since the last read), so a client that
    stops reading pins O(output length) per choice, not one copy of the text per step.
    `close()` aborts whatever is unfinished: call it when the client goes away.
    """

    def __init__(self, owner: "AsyncEngine", request_ids: list[str]):
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


class AsyncEngine:
    def __init__(
        self,
        make_engine: Callable[[], Any],
        on_step: Callable[[Turn], None] | None = None,
        *,
        process: bool = False,
        setup_process: Callable[[], None] | None = None,
    ):
        """make_engine runs on the engine thread, so that the thread that calls the engine
        is also the one that built it; with process=True it runs in the engine process
        (after setup_process), and it and every call's fn must pickle. on_step(turn) runs on
        the event loop after each turn."""
        self._make_engine = make_engine
        self._on_step = on_step
        self._process = process
        self._setup_process = setup_process
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # (stream, its requests, arrival time, the LoRA adapter of them all or None)
        self._adds: list[tuple[RequestStream, list[tuple[str, Any, Any]], float, str | None]] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[asyncio.Future, Callable[[Any], Any]]] = []
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Touched only on the event loop thread.
        self._streams: dict[str, RequestStream] = {}
        self._num_submitted_not_added = 0
        self.loaded: asyncio.Future | None = None
        self.stats: EngineStats | None = None  # after the latest step; None until loaded
        self.config = None  # the engine's resolved EngineConfig, once loaded
        self.tokenizer = None
        self.failure: BaseException | None = None

    # ---- event loop side -------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.loaded = self._loop.create_future()
        if self._process:
            from batchpilot.server.engine_process import EngineProcess

            self._threads = EngineProcess(self).start()
        else:
            self._threads = [threading.Thread(target=self._run, name="engine", daemon=True)]
            self._threads[0].start()

    @property
    def is_loaded(self) -> bool:
        return self.loaded is not None and self.loaded.done() and not self.loaded.exception()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus those handed over but
        not yet picked up by the engine thread."""
        waiting = self.stats.num_waiting if self.stats is not None else 0
        return waiting + self._num_submitted_not_added

    async def submit(self, requests: list[tuple[str, Any, Any]], lora_name: str | None = None
                     ) -> RequestStream:  # fmt: skip
        """requests: (request_id, prompt or token ids, SamplingParams), all for the LoRA
        adapter lora_name (None: the base model). Returns once the engine accepted them
        all; raises the engine's rejection (RequestRejected, a ValueError) if it refused
        any, in which case none of them runs."""
        if self.failure is not None:
            raise EngineFailed(f"the engine failed: {self.failure!r}")
        if not self.is_loaded:
            raise EngineNotReady("the engine is still loading")
        stream = RequestStream(self, [rid for rid, _, _ in requests])
        for rid in stream.request_ids:
            self._streams[rid] = stream
        self._num_submitted_not_added += len(requests)
        with self._lock:
            self._adds.append((stream, requests, time.monotonic(), lora_name))
        self._wake.set()
        try:
            await asyncio.shield(stream.admitted)
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            self._forget(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._forget(request_ids)
        with self._lock:
            self._aborts.extend(request_ids)
        self._wake.set()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between two steps and return its result."""
        if not self.is_loaded:
            raise EngineNotReady("the engine is still loading")
        future = self._loop.create_future()
        with self._lock:
            self._calls.append((future, fn))
        self._wake.set()
        return await future

    async def shutdown(self) -> None:
        """Abort whatever still runs and stop the engine thread."""
        self._end_streams(EngineFailed("the server shut down before this request finished"))
        self._stopping = True
        self._wake.set()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 30)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _deliver(self, result: StepResult) -> None:
        for stream, error in result.admissions:
            self._num_submitted_not_added -= len(stream.request_ids)
            if not stream.admitted.done():
                if error is None:
                    stream.admitted.set_result(None)
                else:
                    stream.admitted.set_exception(error)
        for future, value, error in result.call_results:
            if future.done():
                continue
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
        turn = result.turn
        self.stats = turn.stats
        if result.config is not None:
            self.config = result.config
        for out in turn.outputs:
            if out.error is not None and out.request_id in self._streams:
                self._fail_request(self._streams[out.request_id], out.error)
        by_stream: dict[int, tuple[RequestStream, list]] = {}
        for out in turn.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client in the meantime
            by_stream.setdefault(id(stream), (stream, []))[1].append(out)
            if out.finished:
                del self._streams[out.request_id]
        for stream, outs in by_stream.values():
            stream.put(outs)
        if self._on_step is not None:
            self._on_step(turn)

    def _fail_request(self, stream: RequestStream, message: str) -> None:
        """One of stream's requests failed: the client gets the error, not fewer choices,
        so the others are aborted."""
        stream.fail(RequestFailed(message))
        self.abort([rid for rid in stream.request_ids if rid in self._streams])

    def _loaded(self, engine_config, tokenizer, stats: EngineStats) -> None:
        self.config = engine_config
        self.tokenizer = tokenizer
        self.stats = stats
        if not self.loaded.done():  # a shutdown during loading cancelled the wait
            self.loaded.set_result(None)

    def _failed(self, error: BaseException, loading: bool) -> None:
        self.failure = error
        if loading and not self.loaded.done():
            self.loaded.set_exception(error)
            self.loaded.exception()  # marks it retrieved: the caller of serve() reports it
        self._end_streams(EngineFailed(f"the engine failed: {error!r}"))

    def _end_streams(self, error: EngineFailed) -> None:
        request_ids = list(self._streams)
        for stream in set(self._streams.values()):
            if not stream.admitted.done():
                stream.admitted.set_exception(error)
            stream.fail(error)
        self.abort(request_ids)

    # ---- engine thread (or the engine process's pipe threads) ------------------------

    def _take(self) -> tuple[list, list[str], list]:
        """What the event loop handed over since the last turn."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            self._wake.clear()
        return adds, aborts, calls

    @staticmethod
    def _result(turn: Turn, adds: list, calls: list, config=None) -> StepResult:
        """The turn, its admissions and call results matched back to their streams and
        futures (a turn keeps the order they were handed over in)."""
        admissions = [(add[0], error) for add, error in zip(adds, turn.admissions, strict=True)]
        results = [(call[0], value, error)
                   for call, (value, error) in zip(calls, turn.call_results, strict=True)]  # fmt: skip
        return StepResult(turn, admissions, results, config)

    def _run(self) -> None:
        loop = self._loop
        try:
            engine = self._make_engine()
            loop.call_soon_threadsafe(self._loaded, engine.config, engine.tokenizer, engine.stats())
        except BaseException as e:
            logger.exception("loading the engine failed")
            loop.call_soon_threadsafe(self._failed, e, True)
            return
        try:
            self._serve(EngineCore(engine))
        except BaseException as e:
            logger.exception("the engine failed; no further requests can be served")
            loop.call_soon_threadsafe(self._failed, e, False)

    def _serve(self, core: EngineCore) -> None:
        while True:
            adds, aborts, calls = self._take()
            if not (adds or aborts or calls) and not core.has_work():
                if self._stopping:
                    return
                self._wake.wait()
                continue
            turn = core.turn([add[1:] for add in adds], aborts, [fn for _, fn in calls])
            self._loop.call_soon_threadsafe(self._deliver, self._result(turn, adds, calls))
