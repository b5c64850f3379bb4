"""The `pdserve` console script: one entry point, a subcommand per component.

Each subcommand's module is imported only when it is chosen, so `pdserve operator` never
imports torch and `pdserve worker` never imports kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.protocol.flags import ConfigError

# name -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int; the
# worker's, router's and up's arguments are generated from their config dataclasses
# (pdserve.protocol.flags), and a ConfigError from run() becomes exit code 2.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("pdserve.worker.server.main", "run one engine behind an OpenAI-compatible server"),
    "router": ("pdserve.router.main", "run the OpenAI front door that orchestrates prefill/decode"),
    "operator": ("pdserve.operator.main", "run the Kubernetes operator for ModelServing resources"),
    "up": ("pdserve.cli.launcher", "run a whole prefill/decode stack on this machine"),
    "bench": ("pdserve.bench.main", "run a benchmark and print its table"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r} (choose from {', '.join(SUBCOMMANDS)})")
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except ModuleNotFoundError as e:
        print(f"pdserve {name}: not available in this install ({e})", file=sys.stderr)
        return 2
    cmd = argparse.ArgumentParser(prog=f"pdserve {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(cmd)
    args = cmd.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:  # a component's config rejected a value: name the flag, no traceback
        print(f"pdserve {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
