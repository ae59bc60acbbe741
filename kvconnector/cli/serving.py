"""What the daemons' commands (`kvconnector pool ...`, `kvconnector store ...`) share: running
one command module alone (`python -m kvconnector.cli.store ...`), size arguments, logging to
stderr and stopping on SIGTERM or SIGINT. Standard library only: the store starts without torch.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from kvconnector.cli.units import parse_size


def run_alone(add_parser: Callable[[Any], None], prog: str, argv: list[str] | None) -> int:
    """Parse `argv` with only the subcommand `add_parser` registers, run it: its exit status."""
    parser = argparse.ArgumentParser(prog=prog)
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, answering a usage error in one line (no usage block) and exit status 2."""

    def error(message: str) -> NoReturn:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]
    return parser


def size_arg(text: str) -> int:
    """argparse type for a size ('8GiB'): its bytes; a usage error naming the bad text."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def log_to_stderr() -> None:
    """A serving process's log: INFO and above, timestamped, on stderr."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Call `stop` (which ends serve_forever) on SIGTERM and SIGINT."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop())
