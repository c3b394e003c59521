"""Reads adapters' files on a thread of its own, so that no engine step waits on a disk:
the engine starts a read between two steps and takes the adapter between two later ones.
One read at a time: the reads of a burst would queue on the disk anyway, and a read in
flight holds one of the max_cpu_loras places (manager.py counts it)."""

import concurrent.futures
import logging
from collections.abc import Callable

from batchpilot.server.lora import LoRAError
from batchpilot.server.lora.adapter import LoRAAdapter

logger = logging.getLogger(__name__)


class AdapterReader:
    def __init__(self, read: Callable[[str, str], LoRAAdapter]):
        self._read = read
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on first read
        self._future: concurrent.futures.Future | None = None
        self.name: str | None = None  # the adapter being read

    def start(self, name: str, path: str) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "lora-read")
        self.name = name
        self._future = self._pool.submit(self._read, name, path)

    def done(self) -> tuple[str, LoRAAdapter | LoRAError] | None:
        """The finished read's adapter name and its adapter, or the error that ended it;
        None while a read runs or none was started."""
        future, name = self._future, self.name
        if future is None or not future.done():
            return None
        self._future = self.name = None
        try:
            return name, future.result()
        except LoRAError as e:
            error = e
        except Exception as e:  # the files changed since the adapter was registered
            error = LoRAError(f"adapter {name!r} could not be read again: {e}")
        logger.error("LoRA adapter %s not loaded: %s", name, error)
        return name, error

    def wait(self, timeout: float) -> None:
        """Block until the read in flight ends, at most timeout seconds."""
        if self._future is not None:
            concurrent.futures.wait([self._future], timeout)
