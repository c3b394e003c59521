"""How many threads the CPU engine runs: the process's CPU budget, read without torch.

A container held to N CPUs by a CFS quota still sees every CPU of its node in its affinity.
One OpenMP thread per visible CPU then runs 64 threads under a 2-CPU quota: the quota
stops them mid-step and every barrier waits for the ones descheduled. Measured with the
server image under Docker on a 2-CPU machine: 25.5-28.3 tok/s under a one-CPU quota
(affinity 2) against 55.4-57.4 tok/s pinned to one CPU.

Precedence, first found wins:
1. `--cpu-threads` (EngineConfig.cpu_threads), as given;
2. $BATCHPILOT_CPU_THREADS, a budget capped by the CPU affinity: the operator sets it from
   a CPU pod's CPU limit (which may exceed the node) or request (which the cgroup does not
   show: a request alone sets no quota);
3. $OMP_NUM_THREADS (its first entry), as given: torch honours it by default, so whoever
   set it keeps it;
4. the cgroup CPU quota rounded up, capped by the CPU affinity, at least 1; without a
   quota, the affinity (what the engine ran before).

The parsers take file contents and directories, so tests run them on fixture trees."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from batchpilot import names
from batchpilot.server.config import ConfigError

log = logging.getLogger("batchpilot.engine")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 mounts the cpu controller on its own or together with cpuacct.
V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


@dataclass(frozen=True)
class CpuQuota:
    quota_us: int
    period_us: int

    @property
    def cpus(self) -> Fraction:
        return Fraction(self.quota_us, self.period_us)


@dataclass(frozen=True)
class CpuThreads:
    threads: int
    source: str  # how it was decided, for the start-up log line

    def __str__(self) -> str:
        plural = "" if self.threads == 1 else "s"
        return f"{self.threads} thread{plural}: {self.source}"


def parse_cpu_max(text: str) -> CpuQuota | None:
    """cgroup v2 cpu.max: "max 100000" (no quota) or "200000 100000" (2 CPUs)."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    period = int(fields[1]) if len(fields) > 1 else 100_000
    return _quota(int(fields[0]), period)


def parse_cfs(quota_text: str, period_text: str) -> CpuQuota | None:
    """cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us; a quota of -1 is none."""
    return _quota(int(quota_text.strip()), int(period_text.strip()))


def _quota(quota: int, period: int) -> CpuQuota | None:
    return CpuQuota(quota, period) if quota > 0 and period > 0 else None


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/self/cgroup ("hierarchy:controllers:path" per line) -> {controller: path};
    the cgroup v2 line (hierarchy 0, no controllers) is under ""."""
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _dirs(mount: Path, path: str | None) -> list[Path]:
    """The process's cgroup directory under `mount` and its ancestors up to the mount, where
    that directory exists; else the mount alone. Inside a container the mount is usually
    the container's own cgroup while /proc/self/cgroup names the host's path (no cgroup
    namespace), or "/" (with one)."""
    rel = (path or "/").strip("/")
    here = mount / rel
    # "/.." paths: a cgroup outside this namespace's root, not under the mount.
    if not rel or ".." in rel.split("/") or not here.is_dir():
        return [mount]
    dirs = [here]
    while dirs[-1] != mount:
        dirs.append(dirs[-1].parent)
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _tightest(quotas: list[CpuQuota | None]) -> CpuQuota | None:
    found = [q for q in quotas if q is not None]
    return min(found, key=lambda q: q.cpus) if found else None


def _v2_quota(d: Path) -> CpuQuota | None:
    text = _read(d / "cpu.max")
    return parse_cpu_max(text) if text is not None else None


def _v1_quota(d: Path) -> CpuQuota | None:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    return parse_cfs(quota, period) if quota is not None and period is not None else None


def read_quota(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> CpuQuota | None:
    """The tightest CPU quota on the process's cgroup and its ancestors visible under root:
    cgroup v2 where root is a v2 hierarchy (it has cgroup.controllers), else v1's cpu
    controller. None where there is no quota or nothing can be read. proc_cgroup: the
    text of /proc/self/cgroup (read when None)."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    paths = parse_proc_cgroup(proc_cgroup)
    try:
        if (root / "cgroup.controllers").exists():
            return _tightest([_v2_quota(d) for d in _dirs(root, paths.get(""))])
        for mount in (root / m for m in V1_CPU_MOUNTS):
            if mount.is_dir():
                return _tightest([_v1_quota(d) for d in _dirs(mount, paths.get("cpu"))])
    except (OSError, ValueError):  # unreadable or malformed: no quota known
        return None
    return None


def quota_threads(quota: CpuQuota | None, affinity: int) -> int:
    """ceil(quota) capped by the affinity, at least 1; the affinity without a quota."""
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.ceil(quota.cpus)))


def _env_count(value: str) -> int | None:
    """OMP_NUM_THREADS's first entry ("4" or "4,2") as a positive int, else None."""
    first = value.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) >= 1 else None


def resolve_cpu_threads(flag: int | None, environ: Mapping[str, str], affinity: int,
                        quota: CpuQuota | None) -> CpuThreads:  # fmt: skip
    """The thread count and why, in the precedence of the module's docstring."""
    if flag is not None:
        return CpuThreads(flag, f"--cpu-threads {flag}")
    env = environ.get(names.CPU_THREADS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"{names.CPU_THREADS_ENV} must be an integer >= 1, got {env!r}")
        threads = max(1, min(int(env), affinity))
        return CpuThreads(threads, f"{names.CPU_THREADS_ENV}={env}, affinity {affinity}")
    omp = environ.get("OMP_NUM_THREADS", "")
    if (count := _env_count(omp)) is not None:
        return CpuThreads(count, f"OMP_NUM_THREADS={omp.strip()}")
    threads = quota_threads(quota, affinity)
    if quota is None:
        return CpuThreads(threads, f"no cgroup CPU quota, affinity {affinity}")
    return CpuThreads(threads, f"cgroup quota {float(quota.cpus):g} CPUs, affinity {affinity}")


def cpu_threads(flag: int | None = None) -> int:
    """The engine's CPU thread count from this process's environment, cgroup and affinity;
    logs it with its source."""
    decided = resolve_cpu_threads(flag, os.environ, len(os.sched_getaffinity(0)), read_quota())
    log.info("CPU engine: %s", decided)
    return decided.threads
