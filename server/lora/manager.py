"""An engine's LoRA adapters: the registry's two tiers (registered, loaded in host memory),
the reads that refill the host tier, and the runner's device slots, kept in step. Every
call comes between two steps, from the thread that runs the engine.

Requests are duck-typed sequences: `lora_name` (the adapter asked for) and `lora` (its
loaded copy, None until loaded). A waiting request may lose its copy when the adapter is
evicted for an earlier request's; prepare() binds it again once the adapter is read."""

from collections.abc import Iterable

from batchpilot.server.lora import LoRAError, LoRAInUse
from batchpilot.server.lora.adapter import LoRAAdapter
from batchpilot.server.lora.reader import AdapterReader
from batchpilot.server.lora.registry import LoRARegistry
from batchpilot.server.lora.slots import LoRASlots, module_shapes

# How long an engine with nothing to run waits on a read before it looks again.
IDLE_WAIT_S = 0.05


class LoRAManager:
    def __init__(self, registry: LoRARegistry | None, slots: LoRASlots | None):
        """registry None: LoRA is not enabled, and no adapter loads."""
        self.registry = registry
        self.slots = slots
        self.reader = AdapterReader(registry.read) if registry is not None else None

    @classmethod
    def for_model(cls, config, decoder, slots: LoRASlots | None) -> "LoRAManager":
        registry = None
        if config.enable_lora:
            registry = LoRARegistry(module_shapes(decoder), len(decoder.layers),
                                    config.max_lora_rank, config.lora_capacity)  # fmt: skip
        return cls(registry, slots)

    def for_request(self, name: str | None) -> LoRAAdapter | None:
        """The loaded copy of the adapter a request asks for: None for the base model, or
        where the adapter is registered but not loaded (prepare() reads it). LoRAError
        where none can serve it."""
        if name is None:
            return None
        if self.registry is None:
            raise LoRAError(f"adapter {name!r} asked for but LoRA is not enabled")
        return self.registry.get(name)

    def add(self, name: str, path: str, in_flight: Iterable) -> None:
        """Register a PEFT adapter once its files are read and checked (LoRAError says why
        it cannot serve). It stays loaded where the host tier has room, or an adapter no
        request in in_flight wants to evict; else it is read again on first use."""
        registry = self._enabled()
        registry.check_new(name)
        adapter = registry.read(name, path)
        registry.register(name, path)
        if self._make_room({seq.lora_name for seq in in_flight}):
            registry.loaded[name] = adapter

    def remove(self, name: str, in_flight: Iterable) -> None:
        """Unregister an adapter; LoRAInUse while requests in in_flight (waiting or running)
        ask for it."""
        registry = self._enabled()
        registry.path(name)
        count = sum(1 for seq in in_flight if seq.lora_name == name)
        if count:
            raise LoRAInUse(f"The lora adapter '{name}' has {count} requests in flight; "
                            "unload it once they finish")  # fmt: skip
        adapter = registry.unregister(name)
        if adapter is not None and self.slots is not None:
            self.slots.forget(adapter)

    def names(self) -> list[str]:
        """The registered adapters, in registration order (loaded or not, as vLLM lists)."""
        return list(self.registry.paths) if self.registry else []

    def prepare(self, waiting: Iterable, busy: Iterable) -> list[tuple[object, LoRAError]]:
        """Between steps: take the adapter whose read finished, binding the waiting requests
        that want it, and start reading the next one a waiting request wants. waiting: in
        queue order; busy: the running and swapped requests. -> the waiting requests whose
        adapter could not be read, with why: the engine fails them."""
        if self.reader is None:
            return []
        waiting = list(waiting)
        failed = self._take_read(waiting)
        if self.reader.name is None:
            self._start_read(waiting, {seq.lora_name for seq in busy})
        return failed

    def idle(self) -> None:
        """Nothing could run this step: wait for a read in flight rather than spin."""
        if self.reader is not None:
            self.reader.wait(IDLE_WAIT_S)

    def _take_read(self, waiting: list) -> list[tuple[object, LoRAError]]:
        done = self.reader.done()
        if done is None:
            return []
        name, result = done
        wanting = [seq for seq in waiting if seq.lora_name == name and seq.lora is None]
        if isinstance(result, LoRAError):
            return [(seq, result) for seq in wanting]
        # Its place was made when the read started; an adapter unloaded (or loaded again
        # from elsewhere) meanwhile is dropped.
        if self.registry.paths.get(name) == result.path:
            self.registry.loaded[name] = result
            for seq in wanting:
                seq.lora = result
        return []

    def _start_read(self, waiting: list, pinned: set[str | None]) -> None:
        """Read the adapter of the first waiting request whose adapter is not loaded. Its
        place may evict the least recently used adapter that no running request and no
        request ahead of it wants: later requests never hold an earlier one back, so every
        adapter loads in its turn."""
        for seq in waiting:
            if seq.lora_name is not None and seq.lora is None:
                break
            pinned.add(seq.lora_name)
        else:
            return
        if not self._make_room(pinned):
            return  # every loaded adapter is wanted: it waits for one to finish
        for other in waiting:  # a waiting request holds only loaded adapters
            if (
                other.lora is not None
                and self.registry.loaded.get(other.lora.name) is not other.lora
            ):
                other.lora = None
        self.reader.start(seq.lora_name, self.registry.path(seq.lora_name))

    def _make_room(self, pinned: set[str | None]) -> bool:
        """Room in the host tier for one more adapter (a read in flight holds one), by
        evicting the least recently used one not in pinned; False where all are pinned."""
        registry = self.registry
        if len(registry.loaded) + (self.reader.name is not None) < registry.capacity:
            return True
        victim = registry.victim(pinned)
        if victim is None:
            return False
        adapter = registry.loaded.pop(victim)
        if self.slots is not None:  # as vLLM's: leaving host memory leaves the slots too
            self.slots.forget(adapter)
        return True

    def _enabled(self) -> LoRARegistry:
        if self.registry is None:
            raise LoRAError("LoRA is not enabled: start the server with --enable-lora")
        return self.registry
