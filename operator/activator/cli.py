"""`batchpilot activator`: hold the requests of InferenceServices scaled to zero until a
replica is Ready, then forward them (docs/activator.md).

    batchpilot activator --port 8000 --hold-timeout-seconds 120
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from batchpilot.operator.activator.proxy import (
    BODY_READ_TIMEOUT_SECONDS,
    HOLD_TIMEOUT_SECONDS,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    MAX_HELD_BYTES,
    MAX_HELD_PER_SERVICE,
    Activator,
)


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument(
        "--cluster-domain",
        default="cluster.local",
        help="Host headers <name>.<namespace>.svc.<this> name a service (default cluster.local)",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        dest="namespaces",
        help="a namespace whose services it serves (repeat it; the operator's "
        "watchNamespaces); none: every namespace",
    )
    _add_bounds(parser)


def _add_bounds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-connections",
        type=_positive(int),
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"connections at once; beyond, 503 before reading (default {MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--body-read-timeout-seconds",
        type=_positive(float),
        default=BODY_READ_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"a request body slower than this gets 408 (default {BODY_READ_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--max-held-per-service",
        type=_positive(int),
        default=MAX_HELD_PER_SERVICE,
        metavar="N",
        help="requests held per service; beyond, 429 with Retry-After "
        f"(default {MAX_HELD_PER_SERVICE})",
    )
    parser.add_argument(
        "--hold-timeout-seconds",
        type=_positive(float),
        default=HOLD_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"a request held longer gets 503 (default {HOLD_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=MAX_BODY_BYTES,
        metavar="BYTES",
        help=f"larger request bodies get 413 (default {MAX_BODY_BYTES}, the server's)",
    )

    parser.add_argument(
        "--max-held-bytes",
        type=_positive(int),
        default=MAX_HELD_BYTES,
        metavar="BYTES",
        help="request bodies held at once over every service; beyond, 429 with Retry-After "
        f"(default {MAX_HELD_BYTES}: keep it well under the pod's memory limit)",
    )


def run(args: argparse.Namespace) -> int:
    from batchpilot.operator.activator.kube import KubeTargets
    from batchpilot.operator.kube import new_api_client

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    targets = KubeTargets(new_api_client(), args.namespaces, args.cluster_domain)
    targets.start()
    app = Activator(
        targets.resolve,
        targets.wake,
        targets.endpoints,
        max_held_per_service=args.max_held_per_service,
        hold_timeout=args.hold_timeout_seconds,
        max_body_bytes=args.max_body_bytes,
        max_held_bytes=args.max_held_bytes,
        max_connections=args.max_connections,
        body_read_timeout=args.body_read_timeout_seconds,
        ready=lambda: targets.routes.synced,
    )
    try:
        asyncio.run(_serve(app, args.host, args.port))
    finally:
        targets.stop()
    return 0


async def _serve(app: Activator, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM."""
    runner = await app.start(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logging.getLogger(__name__).info("activator listening on %s:%d", host, port)
    await stop.wait()
    await runner.cleanup()
