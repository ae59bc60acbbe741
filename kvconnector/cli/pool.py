"""`kvconnector pool serve|stats`: run a host's shared pool daemon, print its counters.

    kvconnector pool serve --name NAME --capacity 64GiB --slot-bytes 4MiB

A slot holds one block of every rank of an engine; engines whose block (times their ranks) is
larger are refused with the size they need. Engines use it with `"pool": "NAME"` in their
kv_connector_extra_config.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

from kvconnector.cli.checks import memory_size, slot_size
from kvconnector.cli.serving import log_to_stderr, one_line_errors, run_alone, stop_on_signals
from kvconnector.cli.units import format_size
from transfer.shared import protocol
from transfer.shared.client import PoolClient, PoolError


def add_parser(subparsers: Any) -> None:
    """Register `pool serve` and `pool stats`."""
    pool = subparsers.add_parser("pool", help="the host's shared block pool",
                                 description="Run a host's shared pool daemon or query one.")
    commands = pool.add_subparsers(dest="pool_command", required=True)
    serve = one_line_errors(commands.add_parser("serve",
                                                help="run the pool daemon in the foreground"))
    serve.add_argument("--name", required=True, type=_pool_name,
                       help="the pool's name (engines' 'pool' key)")
    serve.add_argument("--capacity", required=True,
                       type=memory_size("the pool's slots", in_shm=True),
                       help="bytes of shared memory for blocks, e.g. 64GiB (from /dev/shm)")
    serve.add_argument("--slot-bytes", required=True, type=slot_size,
                       help="bytes of one slot, a multiple of 4 KiB: one block of every rank of "
                            "an engine, e.g. 4MiB")
    serve.add_argument("--eviction", choices=("lru", "arc"), default="lru",
                       help="eviction policy across every namespace (default lru)")
    serve.set_defaults(func=_serve)
    stats = one_line_errors(commands.add_parser("stats", help="print a pool's counters as JSON"))
    stats.add_argument("--name", required=True, type=_pool_name)
    stats.set_defaults(func=_stats)


def main(argv: list[str] | None = None) -> int:
    return run_alone(add_parser, "python -m kvconnector.cli.pool", argv)


def _pool_name(text: str) -> str:
    try:
        return protocol.check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    if args.capacity < args.slot_bytes:  # before torch, the daemon and its socket
        print(f"kvconnector pool serve: error: --capacity {format_size(args.capacity)} holds no "
              f"slot of --slot-bytes {format_size(args.slot_bytes)}: the pool holds capacity / "
              f"slot-bytes slots, so give a capacity of at least one slot", file=sys.stderr)
        return 2
    from transfer.shared.daemon import PoolDaemon  # imports torch (the allocator)

    log_to_stderr()
    try:
        daemon = PoolDaemon(args.name, args.capacity, args.slot_bytes, policy=args.eviction)
    except (ValueError, OSError) as exc:
        print(f"kvconnector pool serve: error: {exc}", file=sys.stderr)
        return 2
    stop_on_signals(daemon.stop)
    # Everything alive now (the imports: torch's and numpy's ~170,000 objects; the empty index)
    # lives as long as the process: out of the collector's full passes, which otherwise stopped
    # every engine's requests for 68-81 ms (an H200 machine's host) whenever one ran. One pass
    # first, before any client: what is garbage already is freed, not frozen for good.
    gc.collect()
    gc.freeze()
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
