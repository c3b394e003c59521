"""KV-cache events in vLLM's wire format: which blocks a replica's prefix cache holds, for
a router that sends each request where its prefix is cached (llm-d's precise prefix-cache
scorer; see docs/routing.md).

The block pool reports each block it keys (`BlockStored`), each key it drops
(`BlockRemoved`) and a whole reset (`AllBlocksCleared`); a step's events leave together as
one batch. The payload is vLLM's msgspec layout (`array_like=True, tag=True,
omit_defaults=True`), which llm-d's vLLM adapter decodes (llm-d-kv-cache v0.9.0,
`pkg/kvevents/engineadapter/vllm_adapter.go`): a batch is `[timestamp, [event, ...], rank]`,
an event an array whose first element is its tag.

Block hashes travel as vLLM sends them by default: the last 8 bytes of the block's digest
as an unsigned 64-bit integer. They need not match any hash the router computes: llm-d
keys its index by hashes it derives from each event's token ids (its request keys) and
uses the engine's hashes only to find a block's parent and to remove it. So the default
SHA-256 chain of kv/block_pool.py works, and vLLM's `sha256_cbor` hashing buys nothing."""

import time
from dataclasses import dataclass

import msgpack

# vLLM's name for the tier of the engine's own KV pool (its "GPU" blocks; llm-d lowercases
# it and weights that tier 1.0). A CPU engine's pool is that same tier: its only one.
MEDIUM = "GPU"


def external_hash(digest: bytes) -> int:
    """vLLM's int block hash: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None  # None for a prompt's first block
    token_ids: list[int]
    block_size: int
    lora_name: str | None

    def fields(self) -> list:
        # lora_id (vLLM's deprecated int id) is None: the name identifies the adapter.
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
                self.block_size, None, MEDIUM, self.lora_name]  # fmt: skip


@dataclass
class BlockRemoved:
    block_hashes: list[int]

    def fields(self) -> list:
        return ["BlockRemoved", self.block_hashes, MEDIUM]


@dataclass
class AllBlocksCleared:
    def fields(self) -> list:
        return ["AllBlocksCleared"]


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events of the step in progress, in order. Consecutive blocks of one sequence
    join one BlockStored, as vLLM reports a request's new blocks together."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list[Event] = []

    def stored(self, digest: bytes, parent: bytes | None, tokens: list[int],
               lora_name: str | None) -> None:  # fmt: skip
        """parent: the previous block's digest, None for a prompt's first block."""
        block, parent_hash = external_hash(digest), parent and external_hash(parent)
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and parent_hash is not None
                and last.block_hashes[-1] == parent_hash and last.lora_name == lora_name):  # fmt: skip
            last.block_hashes.append(block)
            last.token_ids.extend(tokens)
            return
        self.events.append(BlockStored([block], parent_hash, list(tokens), self.block_size,
                                       lora_name))  # fmt: skip

    def removed(self, digest: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(digest))
        else:
            self.events.append(BlockRemoved([external_hash(digest)]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


def encode_batch(events: list[Event], timestamp: float | None = None) -> bytes:
    """One batch's msgpack payload: [timestamp, [event, ...], data_parallel_rank]. The rank
    is nil (no data parallelism) but present: llm-d decodes the batch as a 3-field array
    and refuses two."""
    ts = time.time() if timestamp is None else timestamp
    return msgpack.packb([ts, [e.fields() for e in events], None], use_bin_type=True)
