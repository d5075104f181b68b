"""The `gateway` command: one subcommand per module, imported only when used so that
`gateway lint` does not pay for the server stack and `gateway --help` stays instant."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module exposing add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway in front of vLLM replicas (or the simulator)"),
    "sim": ("gateway.sim.cli", "run simulated vLLM replicas on 127.0.0.1"),
    "lint": ("gateway.hygiene.lint", "find prefix-breaking content in logged request bodies"),
    "report": ("gateway.usage.report", "summarise a usage log"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = args_list[0] if args_list and args_list[0] in SUBCOMMANDS else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            modules[name] = module
    args = parser.parse_args(args_list)
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
