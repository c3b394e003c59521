"""The adapters a server serves, in vLLM's two tiers (LRUCacheLoRAModelManager): every
registered adapter by name and path, and at most max_cpu_loras of them loaded in host
memory, least recently used first. An adapter that is registered but not loaded is read
again from its path when a request wants it (manager.py decides when, reader.py reads),
so that activating a loaded one for a step never reads a file.

Registering reads no tensors into the table, only a name and a path, but names come from
load requests: MAX_REGISTERED_LORAS bounds the table (and /v1/models) all the same."""

from collections import OrderedDict

from batchpilot.server.lora import LoRAError, LoRAFull, LoRANotFound
from batchpilot.server.lora.adapter import LoRAAdapter, load_adapter

# Far above any real deployment's adapters (vLLM sets no bound), far below what would
# make the name table or the model list a memory or bandwidth problem.
MAX_REGISTERED_LORAS = 4096


class LoRARegistry:
    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
                 capacity: int):  # fmt: skip
        self.shapes = shapes
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.capacity = capacity  # max_cpu_loras: the most loaded at once
        self.paths: dict[str, str] = {}  # registered, in registration order
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter's files (any thread: it changes nothing here)."""
        return load_adapter(name, path, self.shapes, self.num_layers, self.max_rank)

    def check_new(self, name: str) -> None:
        if name in self.paths:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        if len(self.paths) >= MAX_REGISTERED_LORAS:
            raise LoRAFull(f"{MAX_REGISTERED_LORAS} adapters are registered, the most a "
                           "server holds; unload one first")  # fmt: skip

    def register(self, name: str, path: str) -> None:
        self.check_new(name)
        self.paths[name] = path

    def unregister(self, name: str) -> LoRAAdapter | None:
        """Forget a registered adapter; -> its loaded copy, if it had one."""
        self.path(name)
        del self.paths[name]
        return self.loaded.pop(name, None)

    def path(self, name: str) -> str:
        path = self.paths.get(name)
        if path is None:
            raise LoRANotFound(f"The lora adapter '{name}' cannot be found.")
        return path

    def get(self, name: str) -> LoRAAdapter | None:
        """A registered adapter's loaded copy, now the most recently used; None where it
        is not loaded. LoRANotFound where it is not registered."""
        self.path(name)
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
        return adapter

    def victim(self, pinned: set[str | None]) -> str | None:
        """The least recently used loaded adapter not in pinned, or None."""
        return next((name for name in self.loaded if name not in pinned), None)
