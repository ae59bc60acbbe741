"""keep_received_memory: a thread's freed block buffers are reused, not faulted in afresh.

Each case runs in a fresh interpreter (the setting is process-wide): a thread mallocs 8 buffers
of 2 MiB (as zmq's IO thread does for a request's block frames), writes them, frees them, six
times, counting its page faults per buffer and round. Without the setting every round faults
every page in again (the control: glibc hands the freed heap back to the kernel)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.remote.store import heap

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

ROOT = Path(__file__).resolve().parents[2]
PAGES = (2 << 20) // 4096
PROBE = """
import ctypes, ctypes.util, json, resource, sys, threading
from transfer.remote.store.heap import keep_received_memory
applied = keep_received_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
faults = []
def rounds():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buffers = [libc.malloc(2 << 20) for _ in range(8)]
        for buffer in buffers:
            ctypes.memset(buffer, 1, 2 << 20)
        for buffer in buffers:
            libc.free(buffer)
        faults.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 8)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _environment() -> dict[str, str]:
    """This one, with this tree first on the path and no malloc tunables of its own."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _probe(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120,
                         env=_environment())
    return json.loads(out.stdout)


def test_freed_block_buffers_are_reused_without_faults() -> None:
    kept, control = _probe("keep"), _probe("default")
    assert kept["applied"] is True
    first, *later = kept["faults"]
    assert first >= PAGES / 2  # the first round touches fresh memory either way
    assert max(later) < PAGES / 16, kept  # then the same memory again
    assert min(control["faults"][1:]) > PAGES / 2, control  # every round faults afresh


def test_it_is_set_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_set_thresholds", lambda: calls.append(1) or True)
    assert heap.keep_received_memory() is True and heap.keep_received_memory() is True
    assert calls == [1]
