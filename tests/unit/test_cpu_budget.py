"""The CPU engine's thread count: cgroup v1 and v2 quotas read from fixture trees, the cap by
affinity, and the precedence of the flag and the environment (server/platform/cpu_budget.py)."""

import argparse
import logging
import os
from fractions import Fraction
from pathlib import Path

import pytest

from batchpilot import names
from batchpilot.server.config import ConfigError, EngineConfig, add_engine_args, config_from_args
from batchpilot.server.platform import cpu_budget as cb

# /proc/self/cgroup inside a container with a cgroup namespace (v2), and on a v1 host.
V2_NS = "0::/\n"
V1_HOST = "12:pids:/kube/pod1/c1\n4:cpu,cpuacct:/kube/pod1/c1\n2:memory:/kube/pod1/c1\n0::/\n"


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2(root: Path, files: dict[str, str]) -> Path:
    return write(root, {"cgroup.controllers": "cpuset cpu memory\n", **files})


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("max 100000\n", None),
        ("200000 100000\n", Fraction(2)),
        ("150000 100000\n", Fraction(3, 2)),
        ("50000 100000\n", Fraction(1, 2)),
        ("100000\n", Fraction(1)),  # period left out: the kernel's default 100 ms
        ("", None),
    ],
)
def test_parse_cpu_max(text, cpus):
    quota = cb.parse_cpu_max(text)
    assert (quota.cpus if quota else None) == cpus


@pytest.mark.parametrize(
    "quota, period, cpus",
    [("-1\n", "100000\n", None), ("400000\n", "100000\n", Fraction(4)), ("25000", "50000", 0.5)],
)
def test_parse_cfs(quota, period, cpus):
    got = cb.parse_cfs(quota, period)
    assert (got.cpus if got else None) == cpus


def test_parse_proc_cgroup():
    paths = cb.parse_proc_cgroup(V1_HOST)
    assert paths["cpu"] == paths["cpuacct"] == "/kube/pod1/c1"
    assert paths[""] == "/"
    assert cb.parse_proc_cgroup("garbage\n") == {}


def test_v2_quota_at_the_namespace_root(tmp_path):
    root = v2(tmp_path, {"cpu.max": "200000 100000\n"})
    assert cb.read_quota(root, V2_NS).cpus == 2


def test_v2_no_quota(tmp_path):
    root = v2(tmp_path, {"cpu.max": "max 100000\n"})
    assert cb.read_quota(root, V2_NS) is None


def test_v2_own_cgroup_and_the_tightest_ancestor(tmp_path):
    """On a host (no cgroup namespace) the process's cgroup is a path under the mount; a
    pod's quota on a parent binds as well as the container's own."""
    root = v2(
        tmp_path,
        {
            "kubepods/pod1/cpu.max": "100000 100000\n",
            "kubepods/pod1/c1/cpu.max": "300000 100000\n",
        },
    )
    assert cb.read_quota(root, "0::/kubepods/pod1/c1\n").cpus == 1
    # A path the mount does not hold (a container without a cgroup namespace, whose mount
    # root is its own cgroup): the mount's own files.
    (root / "cpu.max").write_text("400000 100000\n")
    assert cb.read_quota(root, "0::/docker/abc\n").cpus == 4
    # Outside the namespace's root: the mount's own files, never a parent of the mount.
    assert cb.read_quota(root, "0::/../other\n").cpus == 4


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct", "cpuacct,cpu"])
def test_v1_quota(tmp_path, mount):
    root = write(tmp_path, {f"{mount}/cpu.cfs_quota_us": "150000\n",
                            f"{mount}/cpu.cfs_period_us": "100000\n"})  # fmt: skip
    assert cb.read_quota(root, "4:cpu,cpuacct:/\n").cpus == Fraction(3, 2)


def test_v1_no_quota_and_own_cgroup(tmp_path):
    root = write(
        tmp_path,
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/kube/pod1/c1/cpu.cfs_quota_us": "200000\n",
            "cpu,cpuacct/kube/pod1/c1/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cb.read_quota(root, "4:cpu,cpuacct:/\n") is None
    assert cb.read_quota(root, V1_HOST).cpus == 2


def test_no_cgroup_files(tmp_path):
    assert cb.read_quota(tmp_path, V1_HOST) is None
    assert cb.read_quota(tmp_path / "absent", "") is None
    assert cb.read_quota(v2(tmp_path, {}), V2_NS) is None  # a v2 root has no cpu.max
    assert cb.resolve_cpu_threads(None, {}, 64, None).threads == 64


def test_malformed_files_are_no_quota(tmp_path):
    assert cb.read_quota(v2(tmp_path, {"cpu.max": "lots 100000\n"}), V2_NS) is None


@pytest.mark.parametrize(
    "cpus, affinity, threads",
    [
        (Fraction(2), 64, 2),
        (Fraction(3, 2), 64, 2),  # a fractional quota rounds up
        (Fraction(1, 10), 64, 1),  # at least one
        (Fraction(8), 4, 4),  # capped by the affinity
        (None, 6, 6),
        (None, 0, 1),
    ],
)
def test_quota_threads(cpus, affinity, threads):
    quota = cb.CpuQuota(int(cpus * 100_000), 100_000) if cpus is not None else None
    assert cb.quota_threads(quota, affinity) == threads


FOUR = cb.CpuQuota(400_000, 100_000)


def test_precedence_flag_env_omp_quota():
    env = {names.CPU_THREADS_ENV: "3", "OMP_NUM_THREADS": "5"}
    assert str(cb.resolve_cpu_threads(2, env, 64, FOUR)) == "2 threads: --cpu-threads 2"
    assert str(cb.resolve_cpu_threads(None, env, 64, FOUR)) == (
        f"3 threads: {names.CPU_THREADS_ENV}=3, affinity 64"
    )
    assert str(cb.resolve_cpu_threads(None, {"OMP_NUM_THREADS": "5,2"}, 64, FOUR)) == (
        "5 threads: OMP_NUM_THREADS=5,2"
    )
    assert str(cb.resolve_cpu_threads(None, {}, 64, FOUR)) == (
        "4 threads: cgroup quota 4 CPUs, affinity 64"
    )
    assert str(cb.resolve_cpu_threads(None, {}, 2, cb.CpuQuota(150_000, 100_000))) == (
        "2 threads: cgroup quota 1.5 CPUs, affinity 2"
    )
    assert str(cb.resolve_cpu_threads(None, {}, 8, None)) == (
        "8 threads: no cgroup CPU quota, affinity 8"
    )


def test_the_env_budget_is_capped_by_the_affinity_the_flag_and_omp_are_not():
    """BATCHPILOT_CPU_THREADS is a budget (the operator's, from a limit that can exceed the
    node); the flag and OMP_NUM_THREADS are counts someone chose."""
    assert cb.resolve_cpu_threads(None, {names.CPU_THREADS_ENV: "16"}, 4, None).threads == 4
    assert cb.resolve_cpu_threads(16, {}, 4, None).threads == 16
    assert cb.resolve_cpu_threads(None, {"OMP_NUM_THREADS": "16"}, 4, None).threads == 16


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_env_budget_is_refused(value):
    with pytest.raises(ConfigError, match=names.CPU_THREADS_ENV):
        cb.resolve_cpu_threads(None, {names.CPU_THREADS_ENV: value}, 4, None)


@pytest.mark.parametrize("value", ["", "0", "abc", ",4"])
def test_an_unusable_omp_num_threads_falls_through(value):
    assert cb.resolve_cpu_threads(None, {"OMP_NUM_THREADS": value}, 4, FOUR).threads == 4


def test_the_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--cpu-threads", "3"])).cpu_threads == 3
    assert config_from_args(parser.parse_args([])).cpu_threads is None
    with pytest.raises(ConfigError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)


def test_cpu_threads_logs_its_source_once(monkeypatch, caplog):
    monkeypatch.setenv(names.CPU_THREADS_ENV, "1")
    with caplog.at_level(logging.INFO, logger="batchpilot.engine"):
        assert cb.cpu_threads() == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"CPU engine: 1 thread: {names.CPU_THREADS_ENV}=1, affinity {len(os.sched_getaffinity(0))}"
    ]
