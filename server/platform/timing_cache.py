"""The start-up timing verdict cache.

Choices an engine makes by timing two paths at start-up, kept in a file keyed by
everything the choice depends on. Later starts on the same machine read the file instead
of timing again, so two engines there make the same choice rather than each following its
own noisy measurement (their outputs would then differ in the last bits)."""

import contextlib
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from batchpilot.server.platform.cpuinfo import cpu_flags

log = logging.getLogger("batchpilot.engine")


def flags_digest() -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]


def key(**parts) -> str:
    """A verdict's key: the given parts plus what every timing depends on (the CPU's
    flags, torch and the threads it runs on)."""
    machine = dict(cpu_flags=flags_digest(), torch=torch.__version__,
                   threads=torch.get_num_threads())  # fmt: skip
    return json.dumps(machine | parts, sort_keys=True)


def verdict_dir() -> Path:
    """Where verdicts are kept: torch's extensions cache (the operator points
    $TORCH_EXTENSIONS_DIR at a writable volume; a prebuilt kernel's own folder is in the
    image, read-only)."""
    if env := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(env)
    # Imported here: cpp_extension pulls in setuptools, a tenth of a second of every
    # server's start-up (more under load) that only a kernel build or this lookup needs.
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def path_for(directory: Path, kind: str, key: str) -> Path:
    return directory / f"{kind}-verdict-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def read(path: Path, key: str, choices: tuple[str, ...]) -> dict | None:
    """The verdict stored for key, or None (absent, unreadable, another key, a stale choice)."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = verdict.get("key") == key and verdict.get("choice") in choices
    return verdict if ok else None


def write(path: Path, verdict: dict) -> bool:
    """Atomically (engines starting together may race); False where the directory is
    read-only, after a warning: the engine then measures again at its next start."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(verdict, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache a start-up timing verdict in %s: %s", path.parent, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True


def time_both(
    run: Callable[[bool], object], budget_s: float, min_repeats: int, max_repeats: int
) -> tuple[float, float]:
    """Median ms of run(True) and run(False): one warm-up call of each, then as many pairs
    as fit the budget (within the bounds), alternating which goes first, so that drifting
    load from other processes hits both alike."""

    def once(choice: bool) -> float:
        start = time.perf_counter()
        run(choice)
        return time.perf_counter() - start

    warm = once(True) + once(False)
    repeats = min(max_repeats, max(min_repeats, int(budget_s / max(warm, 1e-6))))
    taken: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats):
        for choice in (True, False) if i % 2 == 0 else (False, True):
            taken[choice].append(once(choice))
    return statistics.median(taken[True]) * 1e3, statistics.median(taken[False]) * 1e3
