"""KV-cache events (--kv-events-config): vLLM's payload layout pinned byte for byte, and a
real engine publishing what its prefix cache stores and drops over a real ZMQ socket,
with replay."""

import msgpack
import pytest
import zmq

from batchpilot.server.config import ConfigError, EngineConfig
from batchpilot.server.engine.core import EngineCore
from batchpilot.server.engine.llm_engine import LLMEngine
from batchpilot.server.kv.block_pool import block_digest
from batchpilot.server.kv.event_publisher import END_SEQ, binds
from batchpilot.server.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    encode_batch,
    external_hash,
)
from tests.k8s.cluster import free_port
from tests.support.engine import BLOCK_BYTES_TINY, run_to_completion

BLOCK = 16  # the engine's default block size
TIMEOUT_MS = 60_000  # generous: a loaded machine


def test_a_batch_is_vllms_array_layout_byte_for_byte():
    events = [
        BlockStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2, None),
        BlockStored([9], 7, [5, 6], 2, "sql-lora"),
        BlockRemoved([2**64 - 1]),
        AllBlocksCleared(),
    ]
    payload = encode_batch(events, timestamp=1.5)
    # [ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
    #   lora_name], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]], dp_rank]
    # (llm-d-kv-cache v0.9.0's vllm_adapter.go positions; test_kv_events_llmd.py feeds a
    # real engine's batches to llm-d's own subscriber, decoder and index).
    assert payload.hex() == (
        "93cb3ff8000000000000"
        "94"
        "98ab426c6f636b53746f726564"
        "92cfffffffffffffffff07c0940102030402c0a3475055c0"
        "98ab426c6f636b53746f726564"
        "91090792050602c0a3475055a873716c2d6c6f7261"
        "93ac426c6f636b52656d6f766564"
        "91cfffffffffffffffff"
        "a3475055"
        "91b0416c6c426c6f636b73436c6561726564"
        "c0"
    )


def test_a_sequences_consecutive_blocks_join_one_event_and_adapters_split_them():
    log = KVEventLog(block_size=2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    log.stored(a, None, [1, 2], None)
    log.stored(b, a, [3, 4], None)
    log.stored(c, None, [1, 2], "x")  # another adapter's first block
    log.removed(a)
    log.removed(b)
    events = log.take()
    assert events == [
        BlockStored([external_hash(a), external_hash(b)], None, [1, 2, 3, 4], 2, None),
        BlockStored([external_hash(c)], None, [1, 2], 2, "x"),
        BlockRemoved([external_hash(a), external_hash(b)]),
    ]
    assert log.take() == []


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "not JSON"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be in"),
        ('{"publisher": "kafka"}', "publisher must be"),
        ('{"topic": 5}', "topic must be str"),
        ('{"endpoint": "tcp://*:1", "bogus": 1}', r"unknown fields \['bogus'\]"),
    ],
)
def test_a_bad_config_is_refused_with_its_reason(text, reason):
    with pytest.raises(ConfigError, match=reason):
        EngineConfig(kv_events_config=text)


@pytest.fixture
def publishing(tiny_model):
    """An engine core whose publisher connects to a SUB socket bound on loopback (llm-d's
    central-subscriber mode), with its replay socket on loopback too."""
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.bind(endpoint)
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
              "topic": "kv@pod-a@tiny"}  # fmt: skip
    engine = LLMEngine(model=tiny_model, dtype="float32", max_model_len=96,
                       kv_cache_memory_bytes=12 * BLOCK_BYTES_TINY, kv_events_config=config)  # fmt: skip
    core = EngineCore(engine)
    yield core, sub, replay
    core.close()
    sub.close(linger=0)


def replayed(replay_endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every kept batch from start on, asked for as a subscriber that saw a gap does."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            dealer.close(linger=0)
            return batches
        batches.append((int.from_bytes(seq, "big"), payload))


def events_of(batches: list[tuple[int, bytes]]) -> list[list]:
    return [event for _, payload in batches for event in msgpack.unpackb(payload)[1]]


def test_the_engine_publishes_the_blocks_it_keys_and_drops_and_replays_them(publishing):
    core, sub, replay = publishing
    shared = list(range(1, 2 * BLOCK + 1))  # two full blocks every prompt shares
    run_to_completion(core, "a", [*shared, 40, 41, 42])
    run_to_completion(core, "b", [*shared, 50, 51, 52])  # a prefix-cache hit: nothing new to key
    batches = replayed(replay, 0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    events = events_of(batches)
    assert events[0] == ["AllBlocksCleared"]  # a fresh engine holds nothing
    stored = [e for e in events if e[0] == "BlockStored"]
    first, second = block_digest(None, shared[:BLOCK]), None
    second = block_digest(first, shared[BLOCK:])
    assert stored[0][1][:2] == [external_hash(first), external_hash(second)]
    assert stored[0][2] is None and stored[0][3][: 2 * BLOCK] == shared
    assert stored[0][4:] == [BLOCK, None, "GPU", None]
    keyed = [h for e in stored for h in e[1]]
    assert len(keyed) == len(set(keyed)), "a block shared by b was keyed twice"
    # Live delivery. libzmq passes a bound SUB's subscription on to a connecting PUB only
    # once the SUB polls (libzmq#2267), so batches sent before that are lost (replay above
    # recovers them): new prompts until one arrives, with the SUB polling in between.
    live = []
    for i in range(60):
        run_to_completion(core, f"live{i}", [60 + i] * (BLOCK + 1))
        if sub.poll(1000):
            live.append(sub.recv_multipart())
            break
    assert live, "nothing arrived live"
    kept = dict(replayed(replay, 0))
    for topic, seq, payload in live:
        assert topic == b"kv@pod-a@tiny" and kept[int.from_bytes(seq, "big")] == payload


def test_evicted_blocks_are_published_as_removed(publishing):
    core, _, replay = publishing
    # 12 blocks of KV: three prompts of five blocks evict the first one's cached blocks.
    for i in range(3):
        run_to_completion(core, f"r{i}", [100 * (i + 1) + t for t in range(5 * BLOCK)])
    events = events_of(replayed(replay, 0))
    stored = {h for e in events if e[0] == "BlockStored" for h in e[1]}
    removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
    assert removed and set(removed) <= stored
    assert all(e[2] == "GPU" for e in events if e[0] == "BlockRemoved")


def test_an_endpoint_that_cannot_open_fails_the_start_with_its_reason(tiny_model):
    config = {"enable_kv_cache_events": True, "endpoint": "ipc:///no/such/dir/kv-events"}
    engine = LLMEngine(model=tiny_model, dtype="float32", max_model_len=64,
                       kv_events_config=config)  # fmt: skip
    with pytest.raises(ValueError, match="kv_events_config: cannot open"):
        EngineCore(engine)


def test_wildcards_and_ipc_bind_and_other_endpoints_connect_as_in_vllm():
    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv") and binds("tcp://[::]:5557")
    assert not binds("tcp://epp.ns.svc:5557")
