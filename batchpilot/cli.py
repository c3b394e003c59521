"""`batchpilot` console entry point. Each subcommand's module is imported only when that
subcommand runs, so `batchpilot operator` never loads torch."""

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS = {
    "serve": ("batchpilot.server.api.cli", "serve the OpenAI-compatible API for one model"),
    "bench": ("batchpilot.server.bench.cli", "offline, online and sweep benchmarks"),
    "model": (
        "batchpilot.server.model.cache_fill",
        "model files: `model cache` fills a model cache directory once",
    ),
    "kernels": (
        "batchpilot.server.platform.cpu_kernels",
        "build the CPU kernels ahead of time, so no server start waits for a compiler",
    ),
    "operator": ("batchpilot.operator.cli", "run the Kubernetes operator or print its CRDs"),
    "activator": (
        "batchpilot.operator.activator.cli",
        "hold requests of services scaled to zero until a replica is Ready",
    ),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # allow_abbrev=False here and on every subparser: an abbreviation (`--max-num-seq`) is
    # an unknown flag, never another spelling of a flag (the operator's extraArgs rely on it).
    parser = argparse.ArgumentParser(
        prog="batchpilot",
        allow_abbrev=False,
        description="Continuous-batching LLM server and the Kubernetes operator that tunes it.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if args.version:
        from batchpilot import __version__

        print(__version__)
        return 0
    if args.command is None:
        build_parser([]).print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return module.run(args) or 0
