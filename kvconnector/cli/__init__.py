"""The `kvconnector` command: each subcommand lives with the part it drives and registers itself."""

from __future__ import annotations

import argparse
import importlib

from kvconnector import __version__

# subcommand -> module providing `add_parser(subparsers)`; the parser's `func(args) -> int` runs it.
_SUBCOMMANDS = {
    "backends": "kvconnector.cli.backends",
    "bench": "kvconnector.bench",
    "events": "kvconnector.cli.events",
    "pool": "kvconnector.cli.pool",
    "store": "kvconnector.cli.store",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvconnector", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvconnector {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)

