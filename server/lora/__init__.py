"""Multi-LoRA: PEFT adapters applied per row group in one batch.

adapter.py reads and checks a PEFT adapter against the base model; registry.py holds the
registered ones by name and path, and at most max_cpu_loras of them loaded (least recently
used evicted), which reader.py reads again on a thread of its own and manager.py binds to
the requests that wait for them; slots.py keeps up to max_loras in device tensors and adds
their low-rank products to a step's projections; resolver.py finds an adapter by its name
in --lora-resolver-dir."""


class LoRAError(ValueError):
    """An adapter that cannot be loaded or used; the server answers 400."""


class LoRANotFound(LoRAError):
    """No adapter of that name is loaded; the server answers 404."""


class LoRAFull(LoRAError):
    """MAX_REGISTERED_LORAS adapters are registered already: another registers once one is
    unloaded."""


class LoRAInUse(LoRAError):
    """Requests for the adapter are still waiting or running."""
