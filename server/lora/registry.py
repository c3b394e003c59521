"""The adapters a server has loaded, by name: at most max_cpu_loras, held in host memory
so that activating one for a step never reads a file or fails."""

from batchpilot.server.lora import LoRAError, LoRAFull, LoRANotFound
from batchpilot.server.lora.adapter import LoRAAdapter, load_adapter


class LoRARegistry:
    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
                 capacity: int):  # fmt: skip
        self.shapes = shapes
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.capacity = capacity
        self.adapters: dict[str, LoRAAdapter] = {}  # in load order

    def add(self, name: str, path: str) -> LoRAAdapter:
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        if len(self.adapters) >= self.capacity:
            raise LoRAFull(f"{self.capacity} adapters are loaded, the most --max-cpu-loras "
                            "allows; unload one first")  # fmt: skip
        adapter = load_adapter(name, path, self.shapes, self.num_layers, self.max_rank)
        self.adapters[name] = adapter
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRANotFound(f"The lora adapter '{name}' cannot be found.")
        return adapter

    def remove(self, name: str) -> None:
        self.get(name)
        del self.adapters[name]
