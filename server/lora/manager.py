"""An engine's LoRA adapters: the registry of loaded ones and the runner's device slots,
kept in step. Every call comes between two steps, from the thread that runs the engine."""

from collections.abc import Iterable

from batchpilot.server.lora import LoRAError, LoRAInUse
from batchpilot.server.lora.adapter import LoRAAdapter
from batchpilot.server.lora.registry import LoRARegistry
from batchpilot.server.lora.slots import LoRASlots, module_shapes


class LoRAManager:
    def __init__(self, registry: LoRARegistry | None, slots: LoRASlots | None):
        """registry None: LoRA is not enabled, and no adapter loads."""
        self.registry = registry
        self.slots = slots

    @classmethod
    def for_model(cls, config, decoder, slots: LoRASlots | None) -> "LoRAManager":
        registry = None
        if config.enable_lora:
            registry = LoRARegistry(module_shapes(decoder), len(decoder.layers),
                                    config.max_lora_rank, config.lora_capacity)  # fmt: skip
        return cls(registry, slots)

    def for_request(self, name: str | None) -> LoRAAdapter | None:
        """The adapter a request asks for (None: the base model); LoRAError where none
        can serve it."""
        if name is None:
            return None
        if self.registry is None:
            raise LoRAError(f"adapter {name!r} asked for but LoRA is not enabled")
        return self.registry.get(name)

    def add(self, name: str, path: str) -> None:
        """Load and check a PEFT adapter; LoRAError says why it cannot serve."""
        self._enabled().add(name, path)

    def remove(self, name: str, in_use: Iterable[LoRAAdapter | None]) -> None:
        """Unload an adapter; LoRAInUse while it is among in_use (the adapters of the
        requests waiting or running)."""
        registry = self._enabled()
        adapter = registry.get(name)
        in_flight = sum(1 for used in in_use if used is adapter)
        if in_flight:
            raise LoRAInUse(f"The lora adapter '{name}' has {in_flight} requests in flight; "
                            "unload it once they finish")  # fmt: skip
        registry.remove(name)
        self.slots.forget(adapter)

    def names(self) -> list[str]:
        return list(self.registry.adapters) if self.registry else []

    def _enabled(self) -> LoRARegistry:
        if self.registry is None:
            raise LoRAError("LoRA is not enabled: start the server with --enable-lora")
        return self.registry
