"""`batchpilot bench {offline,serve,sweep,interference,lora,lora-tiers,quality,startup}`."""

import argparse
import importlib

SUBCOMMANDS = {
    "offline": ("batchpilot.server.bench.offline",
                "batchpilot (continuous, static) against transformers peers, one process"),
    "serve": ("batchpilot.server.bench.online",
              "online load generator against any OpenAI-compatible server"),
    "sweep": ("batchpilot.server.bench.sweep",
              "start servers over concurrencies, continuous vs static, and plot the curves"),
    "interference": ("batchpilot.server.bench.interference",
                     "decoders' inter-token latency while a long prompt prefills"),
    "lora": ("batchpilot.server.bench.lora",
             "a batch mixing 4 PEFT adapters and the base against the base alone"),
    "lora-tiers": ("batchpilot.server.bench.lora_tiers",
                   "16 adapters over 4 slots and 8 in host memory against the base model"),
    "quality": ("batchpilot.server.bench.quality",
                "perplexity of a fixed text per weight and KV-cache dtype (fp8's cost)"),
    "startup": ("batchpilot.server.bench.startup",
                "the server's start-up timeline and time to first token, over N starts"),
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(SUBCOMMANDS[args.bench_command][0]).run(args)
