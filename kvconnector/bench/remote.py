"""The remote tier: pool blocks put to and got from an in-process store on loopback.

The store client uses its default connections for this machine (several where cores allow:
transfer.remote.store.lanes). Each security mode (none, shared secret, CURVE) is held against a
raw pyzmq baseline with the same security on the same loopback in the same run
(kvconnector.servers.baseline): as many DEALER connections, the same zero-copy frames in the
same requests and window, to an in-process ROUTER (as the store is in-process: both pay for both
ends) with the store's IO threads, which keeps the frames and sends them back on get. The store
adds the protocol, checksums and its index on top of that.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REMOTE_MAX_BYTES = 256 << 20  # per put/get: enough to reach steady state on loopback
SECURITY_MODES = ("none", "secret", "curve")
_LISTEN = "tcp://127.0.0.1:*"
_TIMEOUT_S = 60.0


def remote_steps(num_cases: int, modes: list[str]) -> int:
    return num_cases * len(modes)


def measure_remote(plan: list[Any], host_arena: torch.Tensor, budget: int, repeats: int,
                   step: Callable[[str], None], modes: list[str]) -> dict[str, Any]:
    """Rows per case and security mode (of SECURITY_MODES); {"skipped": why} where the remote
    tier cannot run."""
    try:
        import zmq

        from transfer.remote.store.client import StoreClient  # noqa: F401  (is the tier built?)
        from transfer.remote.store.server import StoreServer  # noqa: F401
    except ImportError as exc:
        for _ in range(remote_steps(len(plan), modes)):
            step("remote tier: skipped")
        return {"skipped": f"remote tier unavailable: {exc}"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvconnector-bench-") as tmp:
        securities = _securities(Path(tmp), zmq)
        for case, blocks, _ in plan:
            block_bytes = case.layout.block_bytes
            n = max(1, min(blocks, min(REMOTE_MAX_BYTES, budget // 8) // block_bytes))
            pool = host_arena[: 2 * n * block_bytes].view(2 * n, block_bytes)
            for mode in modes:
                step(f"{case.name}: remote tier, security {mode}")
                try:
                    if mode not in securities:
                        raise RuntimeError(f"this libzmq has no {mode.upper()} support")
                    server_sec, client_sec = securities[mode]
                    rows.append(_measure_mode(case, pool, n, mode, server_sec, client_sec,
                                              repeats))
                except Exception as exc:  # a broken mode is a finding; the other modes still run
                    rows.append({"case": case.name, "security": mode, "block_bytes": block_bytes,
                                 "blocks": n, "error": f"{type(exc).__name__}: {exc}"})
    return {"rows": rows, "modes": modes, "max_bytes_per_op": REMOTE_MAX_BYTES}


def _securities(tmp: Path, zmq: Any) -> dict[str, tuple[Any, Any]]:
    """(server, client) Security for every mode this pyzmq supports, with throwaway keys."""
    import zmq.auth

    from transfer.remote.store.security import Security

    modes = {"none": (Security.none(), Security.none())}
    secret = tmp / "secret"
    secret.write_text(f"{random.SystemRandom().getrandbits(128):032x}\n")
    modes["secret"] = (Security.shared_secret(secret), Security.shared_secret(secret))
    if zmq.has("curve"):
        clients = tmp / "clients"
        clients.mkdir()
        server_pub, server_sec = zmq.auth.create_certificates(tmp, "server")
        client_pub, client_sec = zmq.auth.create_certificates(clients, "client")
        modes["curve"] = (Security.curve_server(server_sec, clients),
                          Security.curve_client(client_sec, server_pub))
    return modes


def _measure_mode(case: Any, pool: torch.Tensor, n: int, mode: str, server_sec: Any,
                  client_sec: Any, repeats: int) -> dict[str, Any]:
    from transfer.keys import Namespace
    from transfer.remote.store.client import StoreClient
    from transfer.remote.store.server import StoreServer

    block_bytes = pool.shape[1]
    nbytes = n * block_bytes
    ns = Namespace("kvconnector-bench", str(case.layout.dtype), case.layout.block_size,
                   case.layout.describe())
    keys = ns.keys(list(range(n)))
    rng = random.Random(n)
    put_slots, get_slots = rng.sample(range(0, 2 * n, 2), n), rng.sample(range(1, 2 * n, 2), n)
    pool[put_slots[0]].copy_(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8))

    server = StoreServer(_LISTEN, 2 * nbytes, server_sec)
    endpoint = server.start()
    client = StoreClient(endpoint, client_sec, namespace=ns, pool=pool, timeout_s=_TIMEOUT_S)
    connections = client.connections
    try:
        def put() -> None:
            result = client.put(keys, put_slots)
            if not result.all_ok:
                raise RuntimeError(f"remote put ({mode}) failed: {result.errors[0]!r}")

        def get() -> None:
            result = client.get(keys, get_slots)
            if not result.all_ok:
                raise RuntimeError(f"remote get ({mode}) failed: {result.errors[0]!r}")

        put_s, get_s = _timed(put, repeats), _timed(get, repeats)
        if not torch.equal(pool[get_slots[0]], pool[put_slots[0]]):
            raise RuntimeError(f"remote round trip ({mode}) returned other bytes")
    finally:
        client.close()
        server.stop()
    raw_put, raw_get = _raw_baseline(pool, n, server_sec, client_sec, repeats, connections)
    base = {"put": nbytes / statistics.median(raw_put) / 1e9,
            "get": nbytes / statistics.median(raw_get) / 1e9}

    def rate(seconds: list[float], op: str) -> dict[str, Any]:
        gbps = nbytes / statistics.median(seconds) / 1e9
        return {"gbps": gbps, "ratio": gbps / base[op], "seconds": seconds}

    return {"case": case.name, "security": mode, "block_bytes": block_bytes, "blocks": n,
            "put": rate(put_s, "put"), "get": rate(get_s, "get"),
            "baseline_put_gbps": base["put"], "baseline_get_gbps": base["get"],
            "connections": connections,
            "baseline": f"raw pyzmq, {connections} DEALER connection(s) to an in-process "
                        f"ROUTER, same security, requests, window and IO threads, zero-copy "
                        f"frames (kvconnector/servers/baseline.py)"}


def _timed(fn: Callable[[], None], repeats: int) -> list[float]:
    fn()  # warm-up: connection, handshake, first allocations in the store
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _raw_baseline(pool: torch.Tensor, n: int, server_sec: Any, client_sec: Any,
                  repeats: int, connections: int) -> tuple[list[float], list[float]]:
    """Seconds per round of n blocks put from the even rows and got into the odd rows."""
    from kvconnector.servers.baseline import RawServer, RawStreams
    from transfer.remote.store.client import (
        DEFAULT_GET_BATCH_BYTES,
        DEFAULT_MAX_IN_FLIGHT,
        DEFAULT_PUT_BATCH_BYTES,
        blocks_per_batch,
    )
    from transfer.remote.store.server import DEFAULT_IO_THREADS

    rows: np.ndarray = pool.numpy()
    block_bytes = rows.shape[1]
    server = RawServer(server_sec, 2 * n * block_bytes, DEFAULT_IO_THREADS, _LISTEN)
    streams = None
    try:
        streams = RawStreams(server.start(), client_sec, rows, connections=connections,
                             put_batch_blocks=blocks_per_batch(DEFAULT_PUT_BATCH_BYTES,
                                                               block_bytes),
                             get_batch_blocks=blocks_per_batch(DEFAULT_GET_BATCH_BYTES,
                                                               block_bytes),
                             max_in_flight=DEFAULT_MAX_IN_FLIGHT, timeout_s=_TIMEOUT_S)
        sources, targets = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
        return (_timed(lambda: streams.put(sources), repeats),
                _timed(lambda: streams.get(targets), repeats))
    finally:
        if streams is not None:
            streams.close()
        server.stop()
