"""A replica's adapters as its /metrics say them (vLLM's ``lora_requests_info``): the LoRA
slots, and the adapters of running and of waiting requests, for the LoRA law."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraInfo:
    """One replica's adapters at one scrape: the slots, and the adapters of running and of
    waiting requests."""

    max_loras: int
    running: frozenset[str]
    waiting: frozenset[str]

    @classmethod
    def of(cls, labels: dict[str, str]) -> LoraInfo:
        def names_of(key: str) -> frozenset[str]:
            return frozenset(n for n in labels.get(key, "").split(",") if n)

        return cls(
            int(labels["max_lora"]),
            names_of("running_lora_adapters"),
            names_of("waiting_lora_adapters"),
        )

    def bottleneck(self, running_requests: float, max_num_seqs: float | None) -> bool:
        """Do requests wait for adapters that find no slot, while batch slots are free?"""
        starved = bool(self.waiting - self.running) and len(self.running) >= self.max_loras
        return starved and max_num_seqs is not None and running_requests < max_num_seqs


def newest_lora(samples: list) -> LoraInfo | None:
    """None when absent or unreadable: the LoRA law then sees nothing, the others still
    do (the whole scrape is not lost to one odd family)."""
    newest = max(samples, key=lambda s: s.value, default=None)
    try:
        return LoraInfo.of(newest.labels) if newest is not None else None
    except (KeyError, ValueError):
        return None
