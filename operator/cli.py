"""`batchpilot operator`: run the kopf operator, or write/check the generated CRDs.

    batchpilot operator -A                      # every namespace
    batchpilot operator -n team-a -n team-b     # some namespaces
    batchpilot operator crds --output crds/     # regenerate crds/ from operator/crd/
    batchpilot operator crds --check crds/      # exit 1 when crds/ is stale

Imports stay light until the operator runs: no torch, transformers or triton, ever.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from pydantic import ValidationError

from batchpilot.operator.config import DEFAULT_SERVER_IMAGE, OperatorConfig, describe, env_var

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
# How long a start waits for the API server to serve what the operator watches; then it
# exits 1 and its Deployment restarts it.
SERVED_TIMEOUT_SECONDS = 300.0


def _url_list(text: str) -> list[str]:
    """A comma-separated flag value -> its non-empty URLs."""
    return [u.strip() for u in text.split(",") if u.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("run", "crds"),
        default="run",
        help="run the operator (default), or write the CRDs",
    )
    _scope_arguments(parser.add_argument_group("scope (one of)"))
    operator = parser.add_argument_group("operator")
    _config_arguments(operator)
    _kopf_arguments(operator)
    _crds_arguments(parser.add_argument_group("crds"))


def _scope_arguments(scope: argparse._ArgumentGroup) -> None:
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="serve InferenceServices in every namespace",
    )
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="serve this namespace (repeatable; globs like team-* work)",
    )


def _interval_arguments(run: argparse._ArgumentGroup) -> None:
    """The periods of the reconcile and of the loop."""
    run.add_argument(
        "--reconcile-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="period of each service's check: a full reconcile if it was degraded, routes to "
        f"the activator or is due a resync (${env_var('reconcile_interval')}; default 30)",
    )
    run.add_argument(
        "--resync-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="full reconcile (drift correction) period of a healthy service "
        f"(${env_var('resync_interval')}; default 600)",
    )
    run.add_argument(
        "--loop-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"closed-loop (autoscaling, tuning) period (${env_var('loop_interval')}; default 15)",
    )
    run.add_argument(
        "--status-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="longest wait before the loop's figures are written to status while nothing is "
        f"decided (${env_var('status_interval')}; default 60)",
    )


def _config_arguments(run: argparse._ArgumentGroup) -> None:
    """OperatorConfig's fields: each flag overrides its environment variable."""
    _interval_arguments(run)
    run.add_argument(
        "--server-image",
        default=None,
        help=f"image for InferenceServices without spec.image (${env_var('server_image')}; "
        f"default {DEFAULT_SERVER_IMAGE})",
    )
    run.add_argument(
        "--cluster-domain",
        default=None,
        help=f"for status.url (${env_var('cluster_domain')}; default cluster.local)",
    )
    run.add_argument(
        "--metrics-urls",
        type=_url_list,
        default=None,
        metavar="URL,...",
        help="scrape and tune these replica base URLs instead of the Ready pods "
        f"(servers outside the cluster, tests; ${env_var('metrics_urls')})",
    )
    run.add_argument(
        "--admin-urls",
        type=_url_list,
        default=None,
        metavar="URL,...",
        help="the admin API's base URL of each --metrics-urls URL, in the same order "
        f"(default: each one's host on port 8001; ${env_var('admin_urls')})",
    )
    run.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="handle only the InferenceServices of shard I of N, by a hash of namespace/name "
        f"(one Deployment per I, each with its own --peering; ${env_var('shard')})",
    )
    run.add_argument(
        "--liveness",
        nargs="?",
        const=DEFAULT_LIVENESS,
        default=None,
        metavar="URL",
        help=f"serve a liveness probe, and /metrics on its port (bare --liveness: "
        f"{DEFAULT_LIVENESS}; ${env_var('liveness')})",
    )


def _kopf_arguments(run: argparse._ArgumentGroup) -> None:
    run.add_argument(
        "--standalone", action="store_true", help="no peering even if a KopfPeering object exists"
    )
    run.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="peer with other replicas through KopfPeering NAME (mandatory): "
        "the highest priority runs, the others stand by",
    )
    run.add_argument(
        "--peering-lifetime",
        type=int,
        default=None,
        metavar="SECONDS",
        help="how long a standby waits for a replica that died without leaving "
        f"(${env_var('peering_lifetime')}; default 20)",
    )
    run.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (default: random, so that replicas never tie)",
    )
    run.add_argument("--log-format", choices=("json", "full", "plain"), default="json")
    run.add_argument("-v", "--verbose", action="store_true")
    run.add_argument("--debug", action="store_true")


def _crds_arguments(crds: argparse._ArgumentGroup) -> None:
    crds.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the CRD files here (default: print them)",
    )
    crds.add_argument(
        "--check",
        type=Path,
        default=None,
        metavar="DIR",
        help="exit 1 if the files in DIR differ from the generated ones",
    )


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The environment, overridden by the flags given (a field without a flag: env only)."""
    return OperatorConfig.from_env(
        **{f: getattr(args, f, None) for f in OperatorConfig.model_fields}
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "crds":
        return _crds(args)
    if args.all_namespaces == bool(args.namespace):
        print("batchpilot operator: choose -A/--all-namespaces or -n/--namespace", file=sys.stderr)
        return 2
    if args.standalone and args.peering:
        print("batchpilot operator: --standalone and --peering exclude each other", file=sys.stderr)
        return 2

    import kopf

    from batchpilot.operator import log_filters
    from batchpilot.operator.handlers import WATCHED_KINDS, make_registry
    from batchpilot.operator.kube import wait_until_served

    try:
        config = config_from_args(args)
    except ValidationError as e:
        print(f"batchpilot operator: {describe(e)}", file=sys.stderr)
        return 2
    kopf.configure(
        debug=args.debug,
        verbose=args.verbose,
        log_format={
            "json": kopf.LogFormat.JSON,
            "full": kopf.LogFormat.FULL,
            "plain": kopf.LogFormat.PLAIN,
        }[args.log_format],
        log_refkey="object" if args.log_format == "json" else None,
    )
    log_filters.install(verbose=args.debug or args.verbose)
    try:
        wait_until_served(WATCHED_KINDS, timeout=SERVED_TIMEOUT_SECONDS)
    except RuntimeError as e:
        print(f"batchpilot operator: {e}", file=sys.stderr)
        return 1
    settings = kopf.OperatorSettings()
    if args.peering:
        settings.peering.mandatory = True
    kopf.run(
        registry=make_registry(config),
        settings=settings,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        standalone=args.standalone or None,
        peering_name=args.peering,
        priority=args.priority if args.priority is not None else random.randint(1, 1_000_000),
    )
    return 0


def _crds(args: argparse.Namespace) -> int:
    from batchpilot.operator.crd import manifests

    files = manifests.rendered_files()
    if args.check:
        stale = [
            n
            for n, text in files.items()
            if not (args.check / n).is_file() or (args.check / n).read_text() != text
        ]
        for name in stale:
            print(f"{args.check / name} is stale: run `make crds`", file=sys.stderr)
        return 1 if stale else 0
    if args.output:
        for path in manifests.write_crds(args.output):
            print(path)
        return 0
    sys.stdout.write("---\n".join(text.split("\n", 1)[1] for text in files.values()))
    return 0
