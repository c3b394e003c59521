"""Sharding by a hash of namespace/name: every service has exactly one shard."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.shard import Shard, shard_of


def test_every_service_belongs_to_exactly_one_of_n_shards_and_they_share_evenly():
    names = [(f"team-{i % 37}", f"model-{i}") for i in range(3000)]
    shards = [Shard(i, 3) for i in range(3)]
    owners = [[s.index for s in shards if s.owns(ns, n)] for ns, n in names]
    assert all(len(o) == 1 for o in owners)
    sizes = [sum(o == [i] for o in owners) for i in range(3)]
    assert all(900 <= n <= 1100 for n in sizes), sizes


def test_the_shard_is_a_function_of_namespace_and_name_alone():
    # Not Python's hash(): it differs between processes (PYTHONHASHSEED).
    assert shard_of("a", "b", 7) == shard_of("a", "b", 7)
    assert shard_of("a", "bc", 1000) != shard_of("ab", "c", 1000)  # the separator counts
    assert Shard.parse("2/7").owns("a", "b") == (shard_of("a", "b", 7) == 2)


def test_no_shard_owns_everything():
    assert Shard.parse(None) == Shard.parse("") == Shard(0, 1)
    assert Shard.parse(None).owns("any", "thing")


@pytest.mark.parametrize("bad", ["2/2", "1/0", "-1/2", "a/b", "1", "1/2/3"])
def test_a_shard_outside_its_count_or_not_i_of_n_is_refused(bad):
    with pytest.raises(ValidationError):
        OperatorConfig(shard=bad)


def test_the_flag_reaches_the_config():
    assert str(Shard.parse(OperatorConfig(shard="1/4").shard)) == "1/4"
