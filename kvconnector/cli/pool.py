"""`kvconnector pool serve|stats`: run a host's shared pool daemon, print its counters.

    kvconnector pool serve --name NAME --capacity 64GiB --slot-bytes 4MiB

A slot holds one block of every rank of an engine; engines whose block (times their ranks) is
larger are refused with the size they need. Engines use it with `"pool": "NAME"` in their
kv_connector_extra_config.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvconnector.cli.serving import log_to_stderr, run_alone, size_arg, stop_on_signals
from transfer.shared import protocol
from transfer.shared.client import PoolClient, PoolError


def add_parser(subparsers: Any) -> None:
    """Register `pool serve` and `pool stats`."""
    pool = subparsers.add_parser("pool", help="the host's shared block pool",
                                 description="Run a host's shared pool daemon or query one.")
    commands = pool.add_subparsers(dest="pool_command", required=True)
    serve = commands.add_parser("serve", help="run the pool daemon in the foreground")
    serve.add_argument("--name", required=True, help="the pool's name (engines' 'pool' key)")
    serve.add_argument("--capacity", required=True, type=size_arg,
                       help="bytes of shared memory for blocks, e.g. 64GiB (from /dev/shm)")
    serve.add_argument("--slot-bytes", required=True, type=size_arg,
                       help="bytes of one slot: one block of every rank of an engine, e.g. 4MiB")
    serve.add_argument("--eviction", choices=("lru", "arc"), default="lru",
                       help="eviction policy across every namespace (default lru)")
    serve.set_defaults(func=_serve)
    stats = commands.add_parser("stats", help="print a pool's counters as JSON")
    stats.add_argument("--name", required=True)
    stats.set_defaults(func=_stats)


def main(argv: list[str] | None = None) -> int:
    return run_alone(add_parser, "python -m kvconnector.cli.pool", argv)


def _serve(args: argparse.Namespace) -> int:
    from transfer.shared.daemon import PoolDaemon  # imports torch (the allocator)

    log_to_stderr()
    try:
        daemon = PoolDaemon(args.name, args.capacity, args.slot_bytes, policy=args.eviction)
    except (ValueError, OSError) as exc:
        print(f"kvconnector pool serve: {exc}", file=sys.stderr)
        return 2
    stop_on_signals(daemon.stop)
    info = daemon.info
    print(f"kvconnector pool {args.name}: serving at {daemon.path} segment={info.segment} "
          f"slots={info.num_slots} slot_bytes={info.slot_bytes}", flush=True)
    daemon.serve_forever()
    return 0


def _stats(args: argparse.Namespace) -> int:
    try:
        # A client declares namespaces; stats needs none of its own, any digest will do.
        client = PoolClient(args.name, [bytes(16)], 1)
    except (PoolError, ValueError) as exc:
        print(f"kvconnector pool stats: {exc}", file=sys.stderr)
        return 1
    try:
        stats = client.request(protocol.STATS)
    finally:
        client.close()
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
