"""The event loop's side of an engine that runs elsewhere, on a thread or in a process.

The engine is not thread-safe, so it never runs on the event loop. The loop only appends
to hand-off lists under a lock; whatever drives the engine (async_engine's thread, or
engine_process's pipe threads) takes them between turns and hands each turn's results
back with a single `loop.call_soon_threadsafe` -- once per step, not per token, so the
event loop does not fight the engine for the GIL on every token, and a model step never
blocks the event loop. The public methods below the event-loop ones are that driver's
side, safe to call from its threads."""

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.server.engine.client import (
    EngineFailed,
    EngineNotReady,
    RequestFailed,
    RequestStream,
)
from batchpilot.server.engine.core import Turn
from batchpilot.server.engine.stats import EngineStats

# (stream, its requests, arrival time, the LoRA adapter of them all or None)
Handover = tuple[RequestStream, list[tuple[str, Any, Any]], float, str | None]


@dataclass
class StepResult:
    """One turn of the engine, delivered to the loop at once, with its admissions and call
    results matched back to their streams and futures (which never leave the loop's side)."""

    turn: Turn
    admissions: list  # (RequestStream, exception or None)
    call_results: list  # (future, result, exception or None)
    config: Any = None  # the engine's config after this turn's calls (engine process only)


class HandoffClient:
    """An EngineClient for an engine driven by the threads start_threads() starts."""

    def __init__(self, make_engine: Callable[[], Any],
                 on_step: Callable[[Turn], None] | None = None):  # fmt: skip
        """make_engine() builds the engine where it runs; on_step(turn) runs on the event
        loop after each turn."""
        self.make_engine = make_engine
        self._on_step = on_step
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[Handover] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[asyncio.Future, Callable[[Any], Any]]] = []
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Touched only on the event loop thread.
        self._streams: dict[str, RequestStream] = {}
        self._num_submitted_not_added = 0
        self.loaded: asyncio.Future | None = None
        self.stats: EngineStats | None = None
        self.config = None
        self.tokenizer = None
        self.failure: BaseException | None = None

    def start_threads(self) -> list[threading.Thread]:
        """Start the threads that build and drive the engine; shutdown joins them."""
        raise NotImplementedError

    # ---- event loop side -------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.loaded = self._loop.create_future()
        self._threads = self.start_threads()

    @property
    def is_loaded(self) -> bool:
        return self.loaded is not None and self.loaded.done() and not self.loaded.exception()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus those handed over but
        not yet picked up by the engine."""
        waiting = self.stats.num_waiting if self.stats is not None else 0
        return waiting + self._num_submitted_not_added

    async def submit(self, requests: list[tuple[str, Any, Any]], lora_name: str | None = None
                     ) -> RequestStream:  # fmt: skip
        """As EngineClient.submit."""
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
        """Run fn(engine) where the engine runs, between two steps, and return its result."""
        if not self.is_loaded:
            raise EngineNotReady("the engine is still loading")
        future = self._loop.create_future()
        with self._lock:
            self._calls.append((future, fn))
        self._wake.set()
        return await future

    async def shutdown(self) -> None:
        """Abort whatever still runs and stop the engine's threads."""
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
            _settle(future, value, error)
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

    # ---- the driver's side: the engine's threads ---------------------------------------

    @property
    def stopping(self) -> bool:
        """Whether shutdown asked the engine to stop once the hand-offs are taken."""
        return self._stopping

    def wait_for_work(self) -> None:
        """Block until the event loop hands something over (or asks to stop)."""
        self._wake.wait()

    def take_work(self) -> tuple[list[Handover], list[str], list]:
        """What the event loop handed over since the last take: (adds, aborts, calls)."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            self._wake.clear()
        return adds, aborts, calls

    def deliver_soon(self, turn: Turn, adds: list[Handover], calls: list, config=None) -> None:
        """Hand a turn, with the adds and calls it consumed, to the event loop. A turn keeps
        the order its admissions and call results were handed over in."""
        admissions = [(add[0], error) for add, error in zip(adds, turn.admissions, strict=True)]
        results = [(call[0], value, error)
                   for call, (value, error) in zip(calls, turn.call_results, strict=True)]  # fmt: skip
        result = StepResult(turn, admissions, results, config)
        self._loop.call_soon_threadsafe(self._deliver, result)

    def loaded_soon(self, engine_config, tokenizer, stats: EngineStats) -> None:
        """The engine has loaded: tell the event loop."""
        self._loop.call_soon_threadsafe(self._loaded, engine_config, tokenizer, stats)

    def failed_soon(self, error: BaseException, loading: bool) -> None:
        """The engine ended with error (while loading, or later): tell the event loop."""
        self._loop.call_soon_threadsafe(self._failed, error, loading)

    def fail_call_soon(self, future: asyncio.Future, error: BaseException) -> None:
        """A handed-over call that cannot run: fail it on the event loop."""
        self._loop.call_soon_threadsafe(_settle, future, None, error)


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
