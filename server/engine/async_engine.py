"""AsyncEngine: the LLMEngine on a thread of the server's process, behind asyncio.

Exactly one thread (started here) builds the engine and calls it: it takes what the event
loop handed over (handoff), runs one turn (core), and hands the turn back. With
--engine-process the engine runs in a process of its own instead (engine_process)."""

import logging
import threading

from batchpilot.server.engine.core import EngineCore
from batchpilot.server.engine.handoff import HandoffClient

logger = logging.getLogger(__name__)


class AsyncEngine(HandoffClient):
    """An EngineClient; make_engine runs on the engine thread, so that the thread that
    calls the engine is also the one that built it."""

    def start_threads(self) -> list[threading.Thread]:
        thread = threading.Thread(target=self._run, name="engine", daemon=True)
        thread.start()
        return [thread]

    def _run(self) -> None:
        try:
            engine = self.make_engine()
            core = EngineCore(engine)  # a KV-events endpoint that cannot open fails loading
            self.loaded_soon(engine.config, engine.tokenizer, engine.stats())
        except BaseException as e:
            logger.exception("loading the engine failed")
            self.failed_soon(e, True)
            return
        try:
            self._serve(core)
        except BaseException as e:
            logger.exception("the engine failed; no further requests can be served")
            self.failed_soon(e, False)
        finally:
            core.close()

    def _serve(self, core: EngineCore) -> None:
        while True:
            adds, aborts, calls = self.take_work()
            if not (adds or aborts or calls) and not core.has_work():
                if self.stopping:
                    return
                self.wait_for_work()
                continue
            turn = core.turn([add[1:] for add in adds], aborts, [fn for _, fn in calls])
            self.deliver_soon(turn, adds, calls)
