"""`python -m benchmarks.operator_scale --services N [--services M ...] [--replicas R]
[--out FILE]`: one point per size, each on a fresh control plane, written as JSON. Exits
non-zero if the operator ever connected to anything but loopback."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.operator_scale import faults
from benchmarks.operator_scale.scale import Plan, Point

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_SIZES = (100, 300, 1000)
# The targets at 1,000 services on a 2-core machine.
TARGETS = {
    "reconcile_all_s": 300,
    "max_observe_gap_s": 60,
    "steady_writes_per_service_per_min": 1,
    "operator_rss_mib": 1024,
}


def machine() -> dict:
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return {
        "cpu_model": fields.get("Model name"),
        "cores": int(fields.get("CPU(s)", "0")),
        "flags": fields.get("Flags", "").split(),
        "note": "shared: other work ran on the machine meanwhile",
    }


def targets(point: dict) -> dict[str, bool]:
    """Each target met (True) or missed; a figure not measured is a miss."""
    return {
        key: point.get(key) is not None and point[key] <= limit for key, limit in TARGETS.items()
    }


def qps_setting(text: str) -> tuple[float, int]:
    """``QPS/BURST`` (e.g. ``100/200``) as (QPS, burst)."""
    qps, _, burst = text.partition("/")
    try:
        return float(qps), int(burst or max(1, round(float(qps) * 1.5)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want QPS/BURST, e.g. 100/200") from None


def plan(
    services: int,
    replicas: int,
    steady: float | None,
    restart: bool = False,
    client_qps: tuple[float, int] | None = None,
) -> Plan:
    # The issue asks >= 2 minutes at the big size; smaller ones settle sooner.
    default_steady = 120 if services >= 1000 else 60
    return Plan(
        services=services,
        replicas=replicas,
        steady_seconds=steady or default_steady,
        settle_seconds=30,  # two loop intervals: every service past its first turns
        ready_timeout=max(300, services * 0.9),
        restart_apiserver=restart,
        client_qps=client_qps,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.operator_scale")
    parser.add_argument("--services", type=int, action="append")
    parser.add_argument("--replicas", type=int, default=5)
    parser.add_argument("--steady-seconds", type=float)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--restart-apiserver",
        action="store_true",
        help="the fault: restart kube-apiserver right after the creates; the point gets a "
        "`fault` verdict (nothing recreated or rolled, the operator's own account)",
    )
    parser.add_argument(
        "--control-plane-qps",
        type=qps_setting,
        metavar="QPS/BURST",
        help="raise kube-controller-manager's and kube-scheduler's client limits "
        "(--kube-api-qps/--kube-api-burst; defaults 20/30 and 50/100), as a platform team "
        "running 5,000 pods would; recorded in each point as control_plane_client_qps",
    )
    args = parser.parse_args(argv)
    sizes = args.services or list(DEFAULT_SIZES)
    out = args.out or RESULTS / f"operator-scale-{time.strftime('%Y%m%d', time.gmtime())}.json"
    logs = Path(tempfile.mkdtemp(prefix="operator-scale-logs-"))
    result = {
        "machine": machine(),
        "command": "python -m benchmarks.operator_scale " + shlex.join(argv or sys.argv[1:]),
        "operator": "python -m batchpilot operator, default intervals (loop 15 s, check "
        "30 s, resync 600 s, status 60 s), --standalone",
        "targets_at_1000": TARGETS,
        "logs": str(logs),
        "points": [],
    }
    for services in sizes:
        size = plan(
            services,
            args.replicas,
            args.steady_seconds,
            args.restart_apiserver,
            args.control_plane_qps,
        )
        point = Point(size, logs).run()
        point["targets_met"] = targets(point)
        if "fault" in point:
            point["fault"]["passed"] = faults.passed(point["fault"])
        result["points"].append(point)
        out.write_text(json.dumps(result, indent=2) + "\n")  # a point at a time: keep it
        print(json.dumps({k: v for k, v in point.items() if "address" not in k}), flush=True)
    result["loopback_only"] = all(p["loopback_only"] for p in result["points"])
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}; operator logs in {logs}")
    if not result["loopback_only"]:
        print("FAIL: the operator connected to a non-loopback address", file=sys.stderr)
        return 1
    if not all(p["fault"]["passed"] for p in result["points"] if "fault" in p):
        print("FAIL: the services did not come through the fault intact", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
