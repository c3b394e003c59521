"""`batchpilot serve` flags: the engine's, generated from EngineConfig, and the server's,
with vLLM's names."""

import argparse
import os
import sys

from batchpilot import names
from batchpilot.server.api.app import serve
from batchpilot.server.api.lora_modules import parse_lora_module, parse_lora_module_list
from batchpilot.server.config import add_engine_args

# vLLM's filesystem LoRA resolver reads its directory from this variable; --lora-resolver-dir
# (EngineConfig.lora_resolver_dir) overrides it.
LORA_RESOLVER_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.set_defaults(lora_resolver_dir=os.environ.get(LORA_RESOLVER_DIR_ENV) or None)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=names.DEFAULT_PORT)
    g.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require this bearer token on /v1/* (or $VLLM_API_KEY)",
    )
    g.add_argument(
        "--admin-token",
        default=os.environ.get(names.ADMIN_TOKEN_ENV),
        help=f"bearer token for /admin/* (or ${names.ADMIN_TOKEN_ENV}); "
        "without one the admin API is disabled",
    )
    g.add_argument(
        "--admin-port",
        type=int,
        default=names.DEFAULT_ADMIN_PORT,
        help="port of /admin/*, apart from the public API (on --host, with an admin token)",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="waiting requests beyond this get 429 with Retry-After",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before exiting",
    )
    g.add_argument(
        "--max-request-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413"
    )
    g.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a streamed response may wait on a client that reads nothing before "
        "its request is aborted",
    )
    # uvicorn's own limits, under uvicorn's names (vLLM passes the same through).
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=2048,
        help="open connections and requests beyond this get 503 from uvicorn",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open",
    )
    g.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=16 << 10,
        help="bytes of request line and headers accepted before 431 (vLLM's name; it bounds "
        "httptools, the parser in use, too)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve from start-up, each as name=path or "
        'JSON {"name", "path", "base_model_name"}; implies --enable-lora',
    )
    g.add_argument(
        "--preload-lora-modules",
        type=parse_lora_module_list,
        default=os.environ.get(names.LORA_MODULES_ENV, ""),
        metavar="JSON",
        help="LoRA adapters to load at start-up where, unlike --lora-modules, a bad one is "
        "logged and left out instead of failing the start: a JSON list of "
        f'{{"name", "path"}} (or ${names.LORA_MODULES_ENV}; the operator sets it from '
        "spec.adapters); implies --enable-lora when not empty",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the engine in a process of its own (as vLLM v1's EngineCore), so that "
        "HTTP parsing and streaming never take the GIL from a model step",
    )
    for flag, what in ((names.SLO_TTFT_FLAG, "time to first token"),
                       (names.SLO_TPOT_FLAG, "mean time per output token after the first")):  # fmt: skip
        g.add_argument(
            flag,
            type=slo_seconds,
            default=None,
            help=f"the service's {what} target, seconds: each finished request is counted "
            f"against both targets ({names.SLO_REQUESTS}, {names.SLO_REQUESTS_MET}); the "
            "operator sets them from spec.slo on tuned services",
        )
    g.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine stats log lines (0: off)",
    )


MAX_SLO_SECONDS = 3600.0


def slo_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_SLO_SECONDS:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be over 0 and at most {MAX_SLO_SECONDS:g} s")
    return value


def run(args: argparse.Namespace) -> int:
    # As vLLM refuses to start its resolver on a directory that is not one.
    if args.lora_resolver_dir and not os.path.isdir(args.lora_resolver_dir):
        print(f"--lora-resolver-dir (or ${LORA_RESOLVER_DIR_ENV}) {args.lora_resolver_dir!r} "
              "is not a directory", file=sys.stderr)  # fmt: skip
        return 2
    return serve(args)
