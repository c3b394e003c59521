import argparse

from batchpilot.server.bench import sweep
from batchpilot.server.bench.offline_reference import engine_kwargs_from_serve_args


def parse(argv):
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return parser.parse_args(argv)


def test_concurrency_sweep_starts_one_server_per_policy():
    plan = sweep.server_plan(parse(["--values", "2,8", "--max-num-seqs", "8"]))
    assert plan == [("continuous", 8, [2, 8]), ("static", 8, [2, 8])]


def test_max_num_seqs_sweep_starts_one_server_per_value_with_matching_clients():
    plan = sweep.server_plan(parse(["--sweep", "max-num-seqs", "--values", "4,16",
                                    "--policies", "continuous"]))  # fmt: skip
    assert plan == [("continuous", 4, [4]), ("continuous", 16, [16])]


def test_offline_reference_gets_the_engine_settings_the_server_gets():
    kwargs = engine_kwargs_from_serve_args(
        ["--scheduling-policy", "static", "--max-num-seqs", "12", "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching", "--model", "/m"]
    )  # fmt: skip
    assert kwargs["scheduling_policy"] == "static"
    assert kwargs["max_num_seqs"] == 12
    assert kwargs["dtype"] == "float32"
    assert kwargs["kv_cache_memory_bytes"] == 64 << 20
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["model"] == "/m"
