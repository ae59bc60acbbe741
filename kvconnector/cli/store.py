"""`kvconnector store serve|stats`: run a block store, print a store's counters.

`python -m kvconnector.cli.store store ...` runs the same commands without importing torch (the
`kvconnector` command imports it through the package), so a store starts in a fraction of a
second; the test fixtures use it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import zmq

from kvconnector.cli.checks import listen_address, memory_size, process_count, store_address
from kvconnector.cli.serving import (
    log_to_stderr,
    one_line_errors,
    run_alone,
    size_arg,
    stop_on_signals,
)
from transfer.remote.store.client import StoreClient, StoreError
from transfer.remote.store.protocol import Limits
from transfer.remote.store.security import Security, SecurityMode
from transfer.remote.store.server import DEFAULT_IO_THREADS
from transfer.remote.store.workers import DEFAULT_WORKERS, StoreWorkers, worker_settings

_SECURITY_OPTIONS = {  # option -> (the mode it belongs to, server side, client side)
    "secret_file": (SecurityMode.SECRET, True, True),
    "curve_key_pair": (SecurityMode.CURVE, True, True),
    "curve_clients": (SecurityMode.CURVE, True, False),
    "curve_server_key": (SecurityMode.CURVE, False, True),
}


def add_parser(subparsers: Any) -> None:
    """Register `store serve` and `store stats`."""
    store = subparsers.add_parser("store", help="the remote block store",
                                  description="Run a remote block store or query one.")
    commands = store.add_subparsers(dest="store_command", required=True)
    serve = one_line_errors(commands.add_parser("serve",
                                                help="run a block store in the foreground"))
    serve.add_argument("--listen", default="tcp://127.0.0.1:*", type=listen_address,
                       help="tcp://HOST:PORT to bind, PORT 1-65535 or * for a free one "
                            "(default: loopback, free port; the bound address is printed)")
    serve.add_argument("--capacity", required=True, type=memory_size("the store's blocks"),
                       help="bytes of blocks to hold, e.g. 8GiB (at most this machine's memory)")
    serve.add_argument("--max-block-size", type=size_arg, default=Limits().max_block_bytes,
                       help="largest block accepted (default 64MiB)")
    serve.add_argument("--buffer-budget", type=memory_size("the requests zmq buffers"),
                       help="what zmq may hold for all connections together before the peer "
                            "holding the most is dropped (default: 256MiB or four of the "
                            "largest requests, whichever is more; each worker its own)")
    serve.add_argument("--io-threads", type=process_count, default=DEFAULT_IO_THREADS,
                       help="zmq IO threads in all, split over the workers: connections are "
                            "received and sent in parallel over them (default: half the "
                            f"cores, at most 8; here {DEFAULT_IO_THREADS}; accepted: up to twice "
                            "the cores, 8 on fewer than 4)")
    serve.add_argument("--workers", type=process_count, default=DEFAULT_WORKERS,
                       help="processes serving the store, the keys split among them by hash, "
                            "each with its share of the capacity; the first listens on "
                            "--listen, the others on free ports of the same host (default: half "
                            f"the cores, at most 8, one on 2 cores; here {DEFAULT_WORKERS}; "
                            "accepted: up to twice the cores, 8 on fewer than 4)")
    _add_security_options(serve, server=True)
    serve.set_defaults(func=_serve)
    stats = one_line_errors(commands.add_parser("stats", help="print a store's counters as JSON"))
    stats.add_argument("url", type=store_address, help="the store's tcp://HOST:PORT")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    _add_security_options(stats, server=False)
    stats.set_defaults(func=_stats)


def main(argv: list[str] | None = None) -> int:
    return run_alone(add_parser, "python -m kvconnector.cli.store", argv)


def _add_security_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    group = parser.add_argument_group("security (both sides must use the same mode)")
    group.add_argument("--security", choices=[m.value for m in SecurityMode],
                       help="required: curve: encrypted, keys from files; secret: a shared "
                            "secret checked through ZAP (trusted networks); none: loopback only")
    group.add_argument("--secret-file", type=Path, help="secret: file holding the shared secret")
    group.add_argument("--curve-key-pair", type=Path,
                       help="curve: this side's NAME.key_secret from zmq.auth.create_certificates")
    if server:
        group.add_argument("--curve-clients", type=Path,
                           help="curve: directory of the admitted clients' public .key files")
    else:
        group.add_argument("--curve-server-key", type=Path, help="curve: the store's NAME.key")


def _security(args: argparse.Namespace, *, server: bool) -> Security:
    if args.security is None:
        curve = "--curve-clients DIR" if server else "--curve-server-key NAME.key"
        raise ValueError(f"--security is required: secret (a shared secret: --secret-file FILE, "
                         f"the same file on both sides), curve (encrypted: --curve-key-pair "
                         f"NAME.key_secret {curve}) or none (loopback only)")
    mode = SecurityMode(args.security)
    for option, (owner, on_server, on_client) in _SECURITY_OPTIONS.items():
        if not (on_server if server else on_client):
            continue
        flag = "--" + option.replace("_", "-")
        given = getattr(args, option) is not None
        if given and owner is not mode:
            raise ValueError(f"{flag} belongs to --security {owner.value}, not {mode.value}")
        if not given and owner is mode:
            raise ValueError(f"--security {mode.value} needs {flag}")
    if mode is SecurityMode.NONE:
        return Security.none()
    if mode is SecurityMode.SECRET:
        return Security.shared_secret(args.secret_file)
    if server:
        return Security.curve_server(args.curve_key_pair, args.curve_clients)
    return Security.curve_client(args.curve_key_pair, args.curve_server_key)


def _serve(args: argparse.Namespace) -> int:
    log_to_stderr()
    try:
        security = _security(args, server=True)
        limits = Limits(max_block_bytes=args.max_block_size,
                        max_message_bytes=max(Limits().max_message_bytes, args.max_block_size))
        settings = worker_settings(args.listen, args.capacity, security, workers=args.workers,
                                   limits=limits, buffer_budget_bytes=args.buffer_budget,
                                   io_threads=args.io_threads)
        server = settings[0].server()
        endpoint = server.bind()
    except (ValueError, zmq.ZMQError) as exc:
        print(f"kvconnector store serve: error: {exc}", file=sys.stderr)
        return 2
    workers = StoreWorkers(settings[1:])
    try:
        if args.workers > 1:
            server.shard_ports = [int(endpoint.rsplit(":", 1)[1]), *workers.start()]
    except RuntimeError as exc:
        print(f"kvconnector store serve: error: {exc}", file=sys.stderr)
        return 2
    lost: list[str] = []

    def worker_ended(why: str) -> None:
        logging.getLogger("kvconnector.store").error("%s: stopping the store", why)
        lost.append(why)
        server.stop()

    try:
        stop_on_signals(server.stop)
        workers.watch(worker_ended)
        print(f"kvconnector store: listening on {endpoint} security={security.mode.value} "
              f"capacity={args.capacity} workers={args.workers}", flush=True)
        server.serve_forever()
    finally:
        workers.stop()
    return 1 if lost else 0


def _stats(args: argparse.Namespace) -> int:
    try:
        client = StoreClient(args.url, _security(args, server=False), timeout_s=args.timeout)
    except ValueError as exc:
        print(f"kvconnector store stats: error: {exc}", file=sys.stderr)
        return 2
    try:
        stats = client.stats()
    except StoreError as exc:
        print(f"kvconnector store stats: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
