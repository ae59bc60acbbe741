"""The remote tier: pool blocks put to and got from an in-process store on loopback.

Each security mode (none, shared secret, CURVE) is held against a raw pyzmq baseline with the same
security on the same loopback in the same run: one DEALER streams the same blocks, zero-copy, to a
ROUTER that only counts them (put), or receives them into the pool from a ROUTER that only sends
(get). The store adds the protocol, checksums and its index on top of that.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    raw_put, raw_get = _raw_baseline(pool, n, server_sec, client_sec, repeats)
    base = {"put": nbytes / statistics.median(raw_put) / 1e9,
            "get": nbytes / statistics.median(raw_get) / 1e9}

    def rate(seconds: list[float], op: str) -> dict[str, Any]:
        gbps = nbytes / statistics.median(seconds) / 1e9
        return {"gbps": gbps, "ratio": gbps / base[op], "seconds": seconds}

    return {"case": case.name, "security": mode, "block_bytes": block_bytes, "blocks": n,
            "put": rate(put_s, "put"), "get": rate(get_s, "get"),
            "baseline_put_gbps": base["put"], "baseline_get_gbps": base["get"],
            "baseline": "raw pyzmq DEALER/ROUTER, same security, zero-copy frames"}


def _timed(fn: Callable[[], None], repeats: int) -> list[float]:
    fn()  # warm-up: connection, handshake, first allocations in the store
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _raw_baseline(pool: torch.Tensor, n: int, server_sec: Any, client_sec: Any,
                  repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per round of n blocks client -> server (put) and server -> client (get)."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    auth = server_sec.apply_server(ctx, router, _LISTEN)
    router.linger = 0
    # A ROUTER drops what it cannot queue: a get of more blocks than its high-water mark lost the
    # rest, and the run waited out the timeout for them. Mandatory, a send waits for room instead.
    router.router_mandatory = 1
    router.rcvtimeo = router.sndtimeo = int(_TIMEOUT_S * 1000)  # never hang on a lost peer
    router.bind(_LISTEN)
    endpoint = router.last_endpoint.decode()
    rows = pool.numpy()
    source = rows[0]  # the server sends one block's bytes n times: no store behind it
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            ident, op = router.recv_multipart()
            if op == b"put":
                for _ in range(n):
                    router.recv_multipart(copy=False)
                router.send_multipart([ident, b"done"])
            else:
                for _ in range(n):
                    router.send_multipart([ident, source], copy=False)

    thread = threading.Thread(target=serve, name="bench-raw-zmq", daemon=True)
    thread.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvtimeo = int(_TIMEOUT_S * 1000)
    client_sec.apply_client(dealer, endpoint)
    dealer.connect(endpoint)
    slots = list(range(1, 2 * n, 2))

    def put() -> None:
        dealer.send(b"put")
        for i in range(n):
            dealer.send(rows[2 * i], copy=False)
        dealer.recv()

    def get() -> None:
        dealer.send(b"get")
        for slot in slots:
            dealer.recv_into(rows[slot])

    try:
        return _timed(put, repeats), _timed(get, repeats)
    finally:
        stop.set()
        thread.join()
        dealer.close(linger=0)
        router.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
