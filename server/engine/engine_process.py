"""The engine in a process of its own, as vLLM v1's EngineCore: the HTTP process parses,
tokenizes templates, streams and serves metrics, the engine process schedules, runs the
model and detokenizes, and neither takes the GIL from the other.

The HTTP side keeps the hand-off lists (handoff). A sender thread ships what the event
loop handed over through a pipe; the engine process runs core's turns exactly as
the engine thread would, and sends each turn back with the number of hand-overs it
consumed; a receiver thread matches the turn to its streams and futures (the pipe keeps
their order) and delivers it on the event loop. Stream and future objects never cross.
"""

import logging
import multiprocessing
import pickle
import signal
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from batchpilot.server.engine.core import EngineCore, Turn
from batchpilot.server.engine.handoff import HandoffClient

logger = logging.getLogger(__name__)

# A process forked from a process with OpenMP threads and an event loop can deadlock;
# a spawned one imports afresh.
_CONTEXT = multiprocessing.get_context("spawn")


def _portable(error: BaseException) -> BaseException:
    """error, if it survives pickling (the handlers match on its type), or a
    RuntimeError that names it."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _engine_main(conn, make_engine, setup) -> None:
    """The engine process. SIGINT and SIGTERM reach the whole process group (a terminal's
    Ctrl-C, a container runtime's stop): the HTTP process decides when to drain and
    stop, so they are ignored here; the engine stops on "stop", or when the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if setup is not None:
        setup()
    try:
        engine = make_engine()
        core = EngineCore(engine)  # a KV-events endpoint that cannot open fails loading
    except BaseException as e:
        logger.exception("loading the engine failed")
        conn.send(("failed", _portable(e)))
        return
    conn.send(("loaded", engine.config, engine.tokenizer, engine.stats()))
    try:
        _serve(conn, core)
    except (EOFError, BrokenPipeError):
        return  # the HTTP process is gone
    except BaseException as e:
        logger.exception("the engine failed; no further requests can be served")
        conn.send(("failed", _portable(e)))
    finally:
        core.close()


def _serve(conn, core: EngineCore) -> None:
    stopping = False
    while True:
        messages = []
        if not core.has_work():
            if stopping:
                conn.send(("stopped",))
                return
            messages.append(conn.recv())
        while conn.poll():
            messages.append(conn.recv())
        work = [m for m in messages if m[0] == "work"]
        stopping = stopping or len(work) < len(messages)
        if not work and not core.has_work():
            continue
        turn = core.turn(
            [add for m in work for add in m[1]],
            [rid for m in work for rid in m[2]],
            [fn for m in work for fn in m[3]],
        )
        turn.admissions = [e and _portable(e) for e in turn.admissions]
        turn.call_results = [(v, e and _portable(e)) for v, e in turn.call_results]
        calls = any(m[3] for m in work)
        conn.send(("turn", turn, len(work), core.engine.config if calls else None))


class EngineProcessClient(HandoffClient):
    """An EngineClient whose engine runs in a process of its own: make_engine runs there
    (after setup_process), and it and every call's fn must pickle."""

    def __init__(self, make_engine: Callable[[], Any],
                 on_step: Callable[[Turn], None] | None = None,
                 setup_process: Callable[[], None] | None = None):  # fmt: skip
        super().__init__(make_engine, on_step)
        self.setup_process = setup_process
        self._conn = self._process = None
        # (adds, calls) of each hand-over sent and not yet answered by a turn.
        self._in_flight: deque[tuple[list, list]] = deque()

    def start_threads(self) -> list[threading.Thread]:
        self._conn, child_conn = _CONTEXT.Pipe()
        self._process = _CONTEXT.Process(
            target=_engine_main,
            args=(child_conn, self.make_engine, self.setup_process),
            name="batchpilot-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # ours closed: the pipe ends when the engine process does
        threads = [
            threading.Thread(target=self._send_loop, name="engine-send", daemon=True),
            threading.Thread(target=self._receive_loop, name="engine-receive", daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads

    def _send_loop(self) -> None:
        while True:
            self.wait_for_work()
            adds, aborts, calls = self.take_work()
            try:
                if adds or aborts or calls:
                    calls = self._picklable(calls)
                    self._in_flight.append((adds, calls))
                    self._conn.send(
                        ("work", [add[1:] for add in adds], aborts, [fn for _, fn in calls])
                    )
                if self.stopping:
                    self._conn.send(("stop",))
                    return
            except (BrokenPipeError, OSError):
                return  # the engine process ended; the receiver reports it

    def _picklable(self, calls: list) -> list:
        """The calls whose fn pickles; the others fail at once (a programming error)."""
        kept = []
        for future, fn in calls:
            try:
                pickle.dumps(fn)
            except Exception as e:
                error = TypeError(f"an engine call must pickle to reach the engine process: {e}")
                self.fail_call_soon(future, error)
                continue
            kept.append((future, fn))
        return kept

    def _receive_loop(self) -> None:
        loaded = False
        try:
            while True:
                kind, *payload = self._conn.recv()
                if kind == "loaded":
                    loaded = True
                    self.loaded_soon(*payload)
                elif kind == "turn":
                    turn, consumed, config = payload
                    handed = [self._in_flight.popleft() for _ in range(consumed)]
                    adds = [add for a, _ in handed for add in a]
                    calls = [call for _, c in handed for call in c]
                    self.deliver_soon(turn, adds, calls, config)
                elif kind == "failed":
                    self.failed_soon(payload[0], not loaded)
                    return
                else:  # "stopped"
                    return
        except (EOFError, OSError):
            self._process.join(5)
            error = RuntimeError(f"the engine process exited with code {self._process.exitcode}")
            logger.error("%s; no further requests can be served", error)
            self.failed_soon(error, not loaded)
        finally:
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
