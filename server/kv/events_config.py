"""`--kv-events-config`: vLLM's KVEventsConfig, the same JSON fields and defaults, each
bounded before anything binds a socket."""

import json
import typing
from dataclasses import dataclass, fields

MAX_ENDPOINT_CHARS = 512
MAX_TOPIC_CHARS = 512
MAX_COUNT = 10_000_000  # buffer_steps, hwm, max_queue_size


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # vLLM's default follows enable_kv_cache_events: zmq when on, null when off.
    publisher: str | None = None
    # `*` (or `::`, or ipc://) binds: a subscriber connects to each replica (llm-d's pod
    # discovery); any other endpoint connects to one central subscriber.
    endpoint: str = "tcp://*:5557"
    # A ROUTER socket where a subscriber that missed batches asks for them again.
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ's send high-water mark: past it, PUB drops
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""  # llm-d reads kv@<pod>@<model> from it

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher_name == "zmq"

    @property
    def publisher_name(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    def problems(self) -> list[str]:
        """What is wrong with it, each said once; empty when it is usable."""
        ok = [
            (self.publisher_name in ("null", "zmq"), "publisher must be 'null' or 'zmq'"),
            (0 < len(self.endpoint) <= MAX_ENDPOINT_CHARS,
             f"endpoint must be 1 to {MAX_ENDPOINT_CHARS} characters"),
            (self.replay_endpoint is None or 0 < len(self.replay_endpoint) <= MAX_ENDPOINT_CHARS,
             f"replay_endpoint must be 1 to {MAX_ENDPOINT_CHARS} characters"),
            (len(self.topic) <= MAX_TOPIC_CHARS, f"topic must be at most {MAX_TOPIC_CHARS} characters"),
            *[(1 <= getattr(self, name) <= MAX_COUNT, f"{name} must be in [1, {MAX_COUNT}]")
              for name in ("buffer_steps", "hwm", "max_queue_size")],
        ]  # fmt: skip
        return [message for good, message in ok if not good]


def parse_kv_events_config(value: "str | dict | KVEventsConfig") -> KVEventsConfig:
    """The flag's JSON (or a dict) -> KVEventsConfig; ValueError names what is wrong."""
    if isinstance(value, KVEventsConfig):
        return value
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as error:
        raise ValueError(f"kv_events_config is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError("kv_events_config must be a JSON object")
    types = {f.name: f.type for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ValueError(f"kv_events_config: unknown fields {unknown}; known: {sorted(types)}")
    for name, value in data.items():
        if not _has_type(value, types[name]):
            kind = getattr(types[name], "__name__", str(types[name]))
            raise ValueError(f"kv_events_config: {name} must be {kind}, got {value!r}")
    config = KVEventsConfig(**data)
    if problems := config.problems():
        raise ValueError("kv_events_config: " + "; ".join(problems))
    return config


def _has_type(value, kind) -> bool:
    """JSON value against a field's type (bool is no int here, unlike Python's)."""
    allowed = typing.get_args(kind) or (kind,)
    if isinstance(value, bool):
        return bool in allowed
    return isinstance(value, tuple(t for t in allowed if t is not bool))
