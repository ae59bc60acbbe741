"""The Redis tier of `kvconnector bench`: pool blocks put to and got from a Redis Cluster.

Given `--redis-url`, each case's blocks (as many as the zmq remote rows move) go to the cluster
through transfer.remote.redis.backend.RedisClusterBackend, one client, and come back into other
pool slots; the bytes are compared after the last get. The baseline is `redis-benchmark` (Debian's
redis-tools) doing SET and GET of values of the same size (block + the 40 B value header) on the
same cluster in the same run, one connection per master (our one client talks to every master),
with -P 1 and with pipelines as deep as the backend's (`batch_bytes // value`), the stronger of
the two kept per op. Our trials and its runs alternate, and each ratio is the median of one of
ours against the run next to it.

redis-benchmark's figures are checked, not trusted: without -r every connection reuses one key
per master (`key:{tag}:__rand_int__`, literally), which its SET run writes and its GET run then
reads, so after a timed SET run every master must hold a value of the full size under its key (a
GET run is refused before it starts otherwise), and a GET run must make the masters send at least
requests x value bytes (INFO total_net_output_bytes); a GET of a missing key would answer nil and
look fast. A run too short to time is not held to the first rule: -n is one count shared by the
threads of all masters, and the thread of a master that starts late can find it spent (a busy
2-core machine: 8 values reached two masters of three). Its keys and ours are deleted at the end.
Its rate is read at its last progress tick (`progress_rate`): its own final figure understates
it by up to 250 ms of idle threads per run.

redis-benchmark takes a password only with -a (no environment variable or file): for its few
seconds it is visible to local users in the process list. Use a throwaway ACL user for this.

Also used by benchmarks/bench_redis.py (RedisBenchmark).
"""

from __future__ import annotations

import math
import random
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvconnector.bench.remote import REMOTE_MAX_BYTES

REDIS_STEPS_PER_CASE = 1
TOOL = "redis-benchmark"
BASELINE = "redis-benchmark --cluster SET/GET, same value size, one connection per master"
_MIN_BASELINE_BYTES = 512 << 20  # a first guess; runs too short to time are redone longer
_TICK_S = 0.25  # redis-benchmark's progress clock
MIN_TICKS = 4  # progress ticks a timed run must reach: >= 1 s timed
_MAX_ATTEMPTS = 10
_TIMEOUT_S = 120.0
_KEY_PATTERN = "key:{*}:__rand_int__"  # redis-benchmark's SET/GET key without -r


@dataclass(frozen=True)
class BaselineRun:
    values_per_s: float  # at the run's last progress tick
    requests: int  # values the run moved (-n; raised where a shorter run was too short to time)


def progress_rate(stdout: str, op: str) -> tuple[float, int]:
    """(values per second, ticks) from redis-benchmark's progress lines (`-q`, not `--csv`).

    Every 250 ms it prints `SET: rps=... (overall: R)`, R being the values finished so far over
    the time since the start. Its final figure is not used: with --cluster it runs a thread per
    master, and a thread whose connections are done notices the end of the run only at its
    next tick, so that figure counts up to 250 ms of idling (measured: 5-24% under the last
    tick's rate for 1-2 s runs). The rate is R at the last tick; with no tick yet, the final
    figure (an underestimate) with 0 ticks, which is only good for sizing a longer run.
    """
    ticks = [float(m) for m in re.findall(
        rf"{op.upper()}: rps=[\d.]+ \(overall: ([\d.]+)\)", stdout) if float(m) > 0]
    if ticks:
        return ticks[-1], len(ticks)
    final = re.search(rf"{op.upper()}: ([\d.]+) requests per second", stdout)
    if final is None or not float(final.group(1)) > 0:
        raise RuntimeError(f"{TOOL} {op}: no rate in its output: {stdout[-200:]!r}")
    return float(final.group(1)), 0


def redis_steps(num_cases: int) -> int:
    return num_cases * REDIS_STEPS_PER_CASE


class RedisBenchmark:
    """redis-benchmark's SET or GET of one value size on one cluster, each run checked."""

    def __init__(self, url: str, auth: Any) -> None:
        from redis.cluster import ClusterNode, RedisCluster

        from transfer.remote.redis.values import RedisURL

        tool = shutil.which(TOOL)
        if tool is None:
            raise RuntimeError(f"{TOOL} is not on PATH (apt-get install redis-tools)")
        parsed = RedisURL.parse(url)
        user = parsed.user or auth.user
        host, port = parsed.seeds[0]
        self._argv = [tool, "--cluster", "-h", host, "-p", str(port)]
        if auth.password is not None:
            # redis-benchmark reads no password file or env var: -a is the only way in
            self._argv += [*(["--user", user] if user else []), "-a", auth.password]
        tls: dict[str, Any] = {}
        if parsed.tls:
            self._argv.append("--tls")
            if auth.ca_file is not None:
                self._argv += ["--cacert", str(auth.ca_file)]
            tls = {"ssl": True, "ssl_ca_certs": str(auth.ca_file) if auth.ca_file else None}
        self._admin = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in parsed.seeds], username=user,
            password=auth.password, require_full_coverage=False, socket_timeout=_TIMEOUT_S, **tls)
        self._keys: dict[str, list[bytes]] = {}  # master name -> its redis-benchmark keys
        self._requests: dict[tuple[str, int, int, int], int] = {}  # run kind -> -n that timed

    @property
    def masters(self) -> int:
        return len(self._admin.get_primaries())

    def run(self, op: str, value_bytes: int, requests: int, clients: int,
            pipeline: int) -> BaselineRun:
        """One `op` ("set" or "get") run of at least `requests` values, timed at its last
        progress tick (see `progress_rate`). A run too short to give MIN_TICKS ticks is
        repeated with more requests, and later runs of the same kind start from that count.
        RuntimeError where a run failed or did not move full values."""
        kind = (op, value_bytes, clients, pipeline)
        requests = max(requests, self._requests.get(kind, 0))
        if op == "get":
            self._check_values(value_bytes, require=True)
        missing: dict[str, list[int]] = {}
        for _ in range(_MAX_ATTEMPTS):
            stdout = self._run_checked(op, value_bytes, requests, clients, pipeline)
            rate, ticks = progress_rate(stdout, op)
            if ticks >= MIN_TICKS:
                # a timed SET run must have reached every master (see the module docstring)
                missing = self._check_values(value_bytes, require=False) if op == "set" else {}
                if not missing:
                    self._requests[kind] = requests
                    return BaselineRun(rate, requests)
            # Twice MIN_TICKS at the rate seen so far, and at least 4x after a run too short to
            # time (such a run reads its rate low: setup, the final figure's idle wait; from 8
            # requests, doubling took up to 7 runs to time one), 2x after a timed run that missed
            # a master.
            grow = 2 if ticks >= MIN_TICKS else 4
            requests = max(grow * requests, math.ceil(rate * MIN_TICKS * _TICK_S * 2))
        if missing:
            raise RuntimeError(self._no_value_message(value_bytes, missing))
        raise RuntimeError(f"{TOOL} {op}: runs stayed under {MIN_TICKS} progress ticks "
                           f"({requests} requests)")

    def _run_checked(self, op: str, value_bytes: int, requests: int, clients: int,
                     pipeline: int) -> str:
        counter = "total_net_input_bytes" if op == "set" else "total_net_output_bytes"
        before = self._net_bytes(counter)
        argv = [*self._argv, "-t", op, "-d", str(value_bytes), "-n", str(requests),
                "-c", str(clients), "-P", str(pipeline), "-q"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
        if proc.returncode != 0 or f"{op.upper()}: " not in proc.stdout:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{TOOL} {op} failed (exit {proc.returncode}): "
                               f"{' | '.join(tail)}")
        moved = self._net_bytes(counter) - before
        if moved < requests * value_bytes:
            raise RuntimeError(f"{TOOL} {op}: the masters moved {moved} B, less than "
                               f"{requests} x {value_bytes} B: not full values (missing keys?)")
        return proc.stdout

    def cleanup(self) -> None:
        """Delete redis-benchmark's keys, then drop the connection."""
        try:
            for key in {k for keys in self._find_keys().values() for k in keys}:
                self._admin.delete(key)
        finally:
            self._admin.close()

    def _net_bytes(self, counter: str) -> int:
        return sum(self._admin.get_redis_connection(node).info("stats")[counter]
                   for node in self._admin.get_primaries())

    def _find_keys(self) -> dict[str, list[bytes]]:
        return {node.name: list(self._admin.get_redis_connection(node).scan_iter(
                    match=_KEY_PATTERN, count=1000)) for node in self._admin.get_primaries()}

    def _check_values(self, value_bytes: int, require: bool) -> dict[str, list[int]]:
        """{master: sizes of its redis-benchmark keys} for every master holding no value of
        `value_bytes` under one; with `require`, a RuntimeError naming them instead."""
        if not self._keys or not all(self._keys.values()):
            self._keys = self._find_keys()
        missing = {}
        for name, keys in self._keys.items():
            client = self._admin.get_redis_connection(self._admin.get_node(node_name=name))
            sizes = [client.strlen(key) for key in keys]
            if value_bytes not in sizes:
                missing[name] = sizes
        if missing and require:
            raise RuntimeError(self._no_value_message(value_bytes, missing)
                               + f": a {TOOL} get needs a timed set of that size first")
        return missing

    @staticmethod
    def _no_value_message(value_bytes: int, missing: dict[str, list[int]]) -> str:
        where = ", ".join(f"{name} (sizes {sizes})" for name, sizes in missing.items())
        return f"{TOOL} set: no {value_bytes} B value under {_KEY_PATTERN} on master {where}"


def baseline_requests(value_bytes: int, at_least: int) -> int:
    return max(at_least, -(-_MIN_BASELINE_BYTES // value_bytes))


def measure_redis(plan: list[Any], host_arena: torch.Tensor, budget: int, repeats: int,
                  step: Callable[[str], None], url: str, auth: Any) -> dict[str, Any]:
    """Rows per case: our put/get GB/s and, where redis-benchmark runs, its SET/GET."""
    try:
        from transfer.remote.redis.backend import DEFAULT_BATCH_BYTES
        from transfer.remote.redis.values import HEADER_BYTES
    except ImportError as exc:
        for _ in range(redis_steps(len(plan))):
            step("redis tier: skipped")
        return {"skipped": f"redis tier unavailable: {exc}"}
    try:
        baseline: RedisBenchmark | None = RedisBenchmark(url, auth)
        unavailable = ""
    except Exception as exc:  # no tool, or the cluster refuses its admin client
        baseline, unavailable = None, f"{type(exc).__name__}: {exc}"
    rows = []
    try:
        for case, blocks, _ in plan:
            step(f"{case.name}: redis tier")
            block_bytes = case.layout.block_bytes
            n = max(1, min(blocks, min(REMOTE_MAX_BYTES, budget // 8) // block_bytes))
            pool = host_arena[: 2 * n * block_bytes].view(2 * n, block_bytes)
            value_bytes = block_bytes + HEADER_BYTES
            depth = max(1, DEFAULT_BATCH_BYTES // value_bytes)  # the backend's pipelines
            row: dict[str, Any] = {"case": case.name, "block_bytes": block_bytes, "blocks": n,
                                   "value_bytes": value_bytes, "clients": 1}
            try:
                row.update(_measure_case(case, pool, n, repeats, url, auth, baseline, depth))
            except Exception as exc:  # a failed case is a finding; the others still run
                row["error"] = f"{type(exc).__name__}: {exc}"
            if baseline is None and "error" not in row:
                row["baseline_unavailable"] = unavailable
            rows.append(row)
    finally:
        if baseline is not None:
            baseline.cleanup()
    return {"url": _url_without_user(url), "rows": rows, "baseline": BASELINE,
            "max_bytes_per_op": REMOTE_MAX_BYTES}


def _measure_case(case: Any, pool: torch.Tensor, n: int, repeats: int, url: str, auth: Any,
                  baseline: RedisBenchmark | None, depth: int) -> dict[str, Any]:
    from transfer.keys import Namespace
    from transfer.remote.factory import open_backend
    from transfer.remote.redis.values import HEADER_BYTES

    block_bytes = pool.shape[1]
    ns = Namespace("kvconnector-bench-redis", str(case.layout.dtype), case.layout.block_size,
                   case.layout.describe())
    keys = ns.keys(list(range(n)))
    rng = random.Random(n)
    put_slots, get_slots = rng.sample(range(0, 2 * n, 2), n), rng.sample(range(1, 2 * n, 2), n)
    pool[put_slots].copy_(torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8))
    value_bytes = block_bytes + HEADER_BYTES
    requests = baseline_requests(value_bytes, n)
    # -P 1 and our depth: deep pipelines of large SETs cost Redis a copy of its query buffer,
    # so neither is always the stronger; the row holds the stronger of the two
    pipelines = sorted({1, depth})
    masters = baseline.masters if baseline is not None else 0
    ours: dict[str, list[float]] = {"put": [], "get": []}  # seconds for n values
    theirs: dict[tuple[str, int], list[float]] = {(op, p): [] for op in ours for p in pipelines}
    ran: dict[tuple[str, int], int] = {}  # -n of its runs (raised where too short to time)
    baseline_failed = "" if baseline is not None else "no redis-benchmark"
    backend = open_backend(url, auth, namespace=ns, pool=pool, timeout_s=_TIMEOUT_S)
    try:
        def transfer(op: str) -> float:
            t0 = time.perf_counter()
            result = (backend.put(keys, put_slots) if op == "put"
                      else backend.get(keys, get_slots))
            elapsed = time.perf_counter() - t0
            if not result.all_ok:
                bad = next(i for i, ok in enumerate(result.ok) if not ok)
                raise RuntimeError(f"redis {op} failed: {result.errors[bad]!r}")
            return elapsed

        def benchmark(op: str) -> dict[int, float]:
            nonlocal baseline_failed
            if baseline is None or baseline_failed:
                return {}
            try:
                runs = {p: baseline.run("set" if op == "put" else "get", value_bytes, requests,
                                        masters, p) for p in pipelines}
            except Exception as exc:  # ours still stands, without a ratio
                baseline_failed = f"{type(exc).__name__}: {exc}"
                return {}
            for p, run in runs.items():
                ran[(op, p)] = run.requests
            return {p: n / run.values_per_s for p, run in runs.items()}

        for trial in range(repeats + 1):  # the first: connections, slot map, warm-up
            for op in ("put", "get"):
                if trial % 2 == 0:  # alternate which goes first
                    seconds, base = transfer(op), benchmark(op)
                else:
                    base, seconds = benchmark(op), transfer(op)
                if trial > 0:
                    ours[op].append(seconds)
                    for p, t in base.items():
                        theirs[(op, p)].append(t)
        if not torch.equal(pool[get_slots], pool[put_slots]):
            raise RuntimeError("redis round trip returned other bytes")
    finally:
        try:
            backend.delete(keys)
        finally:
            backend.close()
    nbytes = n * block_bytes
    out: dict[str, Any] = {}
    for op in ("put", "get"):
        out[op] = {"gbps": nbytes / statistics.median(ours[op]) / 1e9, "seconds": ours[op]}
        if baseline_failed:
            continue
        best = min(pipelines, key=lambda p: statistics.median(theirs[(op, p)]))
        base = theirs[(op, best)]
        # each of our trials against the baseline run next to it, under the same load
        out[op]["ratio"] = statistics.median(t / s for s, t in zip(ours[op], base, strict=True))
        out[f"baseline_{op}_gbps"] = nbytes / statistics.median(base) / 1e9
        out[f"baseline_{op}_flags"] = {"c": masters, "P": best, "n": ran[(op, best)],
                                        "d": value_bytes}
    if baseline_failed and baseline is not None:
        out["baseline_unavailable"] = baseline_failed
    return out


def _url_without_user(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
