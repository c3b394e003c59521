"""Multi-LoRA: PEFT adapters applied per row group in one batch.

adapter.py reads and checks a PEFT adapter against the base model, registry.py holds the
loaded ones (bounded by max_cpu_loras), slots.py keeps up to max_loras of them in device
tensors and adds their low-rank products to a step's projections; resolver.py finds an
adapter by its name in --lora-resolver-dir."""


class LoRAError(ValueError):
    """An adapter that cannot be loaded or used; the server answers 400."""


class LoRANotFound(LoRAError):
    """No adapter of that name is loaded; the server answers 404."""


class LoRAFull(LoRAError):
    """max_cpu_loras adapters are loaded already: another loads once one is unloaded."""


class LoRAInUse(LoRAError):
    """Requests for the adapter are still waiting or running."""
