"""Sharding: which InferenceServices one operator Deployment handles (``--shard I/N``).

A service belongs to shard ``sha256("namespace/name") mod N``: every process computes the
same answer from the name alone (no coordination, no state), so with one Deployment per
index 0..N-1 each service has exactly one owner. Changing N moves most services to another
shard: restart every shard with the new N together. Each shard runs its own peering
(``--peering batchpilot-shard-I``), so two replicas of one shard are one active, one
standing by, and shards never stand each other by. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SHARD_PATTERN = r"^[0-9]+/[1-9][0-9]*$"


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str | None) -> Shard:
        """ "I/N" with 0 <= I < N; None or "" is the one shard that owns everything."""
        if not text:
            return cls(0, 1)
        index, _, count = text.partition("/")
        shard = cls(int(index), int(count))
        if not 0 <= shard.index < shard.count:
            raise ValueError(f"shard {text}: the index must lie in 0..{shard.count - 1}")
        return shard

    def owns(self, namespace: str | None, name: str | None) -> bool:
        if self.count == 1:
            return True
        return shard_of(namespace or "", name or "", self.count) == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def shard_of(namespace: str, name: str, count: int) -> int:
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % count
