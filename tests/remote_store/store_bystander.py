"""Test support for attacks on a store process: a well-behaved client checking every byte while
they run, the store's memory, and attackers (store_abuse.py) in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from transfer.keys import Namespace
from transfer.remote.store.client import StoreClient
from transfer.remote.store.security import Security

MiB = 1 << 20
ABUSE = Path(__file__).with_name("store_abuse.py")
DEADLINE_S = 30.0  # each call of the well-behaved clients: a liveness bound, not a speed check
NONE = Security.none()
NS = Namespace("bystander", "bfloat16", 16, "BLNHC")


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(value.split()[0]) * 1024
    return values


class Bystander:
    """A well-behaved client: put fresh blocks, get them back into a poisoned pool, compare every
    byte, and ask for stats; round after round until stopped. Its connections are made before
    the attacks start (a store at its connection limit refuses new ones)."""

    def __init__(self, url: str, blocks: int = 16, block_bytes: int = 64 << 10) -> None:
        generator = torch.Generator().manual_seed(37)
        self.source = torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8,
                                    generator=generator)
        self.target = torch.empty_like(self.source)
        self.rounds = 0
        self.failures: list[str] = []
        self._writer = StoreClient(url, NONE, namespace=NS, pool=self.source, timeout_s=DEADLINE_S)
        self._reader = StoreClient(url, NONE, namespace=NS, pool=self.target, timeout_s=DEADLINE_S)
        self._round(0)  # connected, and the store serves
        if self.failures:
            raise AssertionError(f"the store did not serve the bystander: {self.failures}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _round(self, number: int) -> None:
        count = self.source.shape[0]
        keys = NS.keys([b"round-%d-%d" % (number, i) for i in range(count)])
        self.target.fill_(0xA5)
        put = self._writer.put(keys, range(count))
        get = self._reader.get(keys, range(count))
        if not (put.all_ok and get.all_ok):
            self.failures.append(f"round {number}: put {put.errors[:1]} get {get.errors[:1]}")
        elif not torch.equal(self.target, self.source):
            self.failures.append(f"round {number}: the bytes read back differ")
        else:
            try:
                self._writer.stats()
                self.rounds += 1
            except Exception as exc:
                self.failures.append(f"round {number}: stats: {exc}")

    def _run(self) -> None:
        for number in range(1, 100_000):  # bounded; stopped long before
            if self._stop.is_set() or self.failures:
                break
            self._round(number)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * DEADLINE_S)
        self._writer.close()
        self._reader.close()


def start_attack(kind: str, url: str, seconds: float, seed: int = 37,
                 arg: int | None = None) -> subprocess.Popen[bytes]:
    """An attacker process (store_abuse.py); its stdin and stdout are pipes."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                         os.environ.get("PYTHONPATH")]))
    command = [sys.executable, str(ABUSE), kind, url, str(seconds), str(seed)]
    if arg is not None:
        command.append(str(arg))
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path})


def finish_attack(attacker: subprocess.Popen[bytes], timeout_s: float = 60.0, *,
                  terminate: bool = True) -> dict[str, int]:
    """SIGTERM an attacker (unless not `terminate`: it ends by itself) and return its summary
    (SIGKILL if it does not end within `timeout_s`)."""
    try:
        if terminate and attacker.poll() is None:
            attacker.terminate()
        out, _ = attacker.communicate(timeout=timeout_s)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    lines = out.decode().strip().splitlines()
    assert lines, f"attacker ended with {attacker.returncode} and no summary"
    return json.loads(lines[-1])


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0,
             interval_s: float = 0.1) -> bool:
    """Poll `condition()` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())
