"""Publishing a step's KV events over ZMQ as vLLM does, off the engine's thread.

Each batch is one three-frame message on a PUB socket: the topic, an 8-byte big-endian
sequence number, the msgpack payload (kv/events.py). The last `buffer_steps` batches are
kept; a subscriber that saw a gap sends `[b"", start_seq]` to the ROUTER socket at
`replay_endpoint` and gets every kept batch from start_seq on as `[b"", seq, payload]`,
then `[b"", END_SEQ, b""]` (vLLM's replay protocol).

The engine thread only appends to a bounded queue: encoding and sending never lengthen a
step, and when the queue is full the batch is dropped and counted (as a router's index
is approximate anyway) rather than stalling generation."""

import logging
import queue
import threading
import time
from collections import deque

import zmq

from batchpilot.server.kv.events import AllBlocksCleared, Event, encode_batch
from batchpilot.server.kv.events_config import KVEventsConfig

log = logging.getLogger("batchpilot.engine")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How long the thread sleeps on an empty queue before it looks for replay requests: a
# replay waits at most this long, a batch not at all.
WAIT_S = 0.05


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or ipc:// endpoint is bound, any other is connected to."""
    return endpoint.startswith("ipc://") or "*" in endpoint or "::" in endpoint


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.topic = config.topic.encode()
        self.pending: queue.Queue[tuple[float, list[Event]]] = queue.Queue(config.max_queue_size)
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = 0  # batches the full queue turned away
        self.closing = False
        self.next_seq = 0
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()
        self.ready.wait()
        if self.failure is not None:  # a bad endpoint fails the start, not a later step
            raise self.failure
        self.publish([AllBlocksCleared()])  # a restarted replica holds nothing cached

    def publish(self, events: list[Event]) -> None:
        """Hand over one step's events (nothing when there are none)."""
        if not events:
            return
        try:
            self.pending.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        self.closing = True
        self.thread.join(timeout=10)

    def _run(self) -> None:
        context = zmq.Context.instance()
        try:
            pub, replay = self._sockets(context)
        except zmq.ZMQError as error:
            self.failure = ValueError(f"kv_events_config: cannot open {error}")
            self.ready.set()
            return
        self.ready.set()
        try:
            while not self.closing:
                self._send_pending(pub)
                while replay is not None and replay.poll(0):
                    self._answer_replay(replay)
            self._send_pending(pub)  # what the last steps queued
        finally:
            for socket in (pub, replay):
                if socket is not None:
                    socket.close(linger=0)

    def _sockets(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = context.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        endpoint = self.config.endpoint
        pub.bind(endpoint) if binds(endpoint) else pub.connect(endpoint)
        replay = None
        if self.config.replay_endpoint is not None:
            replay = context.socket(zmq.ROUTER)
            replay.bind(self.config.replay_endpoint)
        return pub, replay

    def _send_pending(self, pub: zmq.Socket) -> None:
        """Send every queued batch, waiting up to WAIT_S for the first."""
        try:
            timestamp, events = self.pending.get(timeout=WAIT_S)
        except queue.Empty:
            return
        while True:
            payload = encode_batch(events, timestamp)
            pub.send_multipart((self.topic, self.next_seq.to_bytes(8, "big"), payload))
            self.kept.append((self.next_seq, payload))
            self.next_seq += 1
            try:
                timestamp, events = self.pending.get_nowait()
            except queue.Empty:
                return

    def _answer_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.kept):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
