"""Both engine clients, in thread and in process, implement EngineClient, the interface
the API is typed against: every member, with the protocol's signature."""

import inspect

import pytest

from batchpilot.server.engine.async_engine import AsyncEngine
from batchpilot.server.engine.client import EngineClient
from batchpilot.server.engine.engine_process import EngineProcessClient

CLIENTS = [AsyncEngine, EngineProcessClient]


def protocol_methods() -> dict[str, object]:
    members = vars(EngineClient).items()
    return {name: member for name, member in members if not name.startswith("_")
            and (inspect.isfunction(member) or isinstance(member, property))}  # fmt: skip


def parameters(fn) -> list[tuple]:
    """Names, kinds and defaults; annotations may be spelt differently."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_names_what_the_api_uses():
    assert set(protocol_methods()) == {
        "is_loaded", "num_waiting", "start", "submit", "abort", "call", "shutdown",
    }  # fmt: skip
    assert set(EngineClient.__annotations__) == {
        "loaded", "stats", "config", "tokenizer", "failure",
    }  # fmt: skip


@pytest.mark.parametrize("cls", CLIENTS)
def test_every_method_and_property_matches_the_protocol(cls):
    for name, wanted in protocol_methods().items():
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        if isinstance(wanted, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert inspect.isfunction(got), f"{cls.__name__}.{name} is not a method"
        assert parameters(got) == parameters(wanted), f"{cls.__name__}.{name}"
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name


@pytest.mark.parametrize("cls", CLIENTS)
def test_every_attribute_exists_on_a_new_client(cls):
    client = cls(lambda: None)
    for name in EngineClient.__annotations__:
        assert hasattr(client, name), f"{cls.__name__} lacks {name}"
    assert isinstance(client, EngineClient)
