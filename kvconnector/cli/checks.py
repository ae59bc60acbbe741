"""What a daemon's command line asks of this machine, checked while the line is parsed, before
anything starts: listen addresses, process counts against the cores, sizes against the memory.

Each check is an argparse `type` (an ArgumentTypeError names the bad value and what is accepted:
one line, exit 2). Standard library only: the store starts without torch.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path

from kvconnector.cli.units import format_size, parse_size

SHM_DIR = "/dev/shm"  # where a shared pool's slots live (kvconnector.layout.allocator)
PAGE_BYTES = 4096  # engines round each rank's block up to this (HOST_ALIGNMENT)
_CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 62  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1
_PORT = re.compile(r"[0-9]{1,5}")
_LISTEN_FORM = ("tcp://HOST:PORT (e.g. tcp://127.0.0.1:7701, tcp://[::1]:7701; PORT * picks a "
                "free one)")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under taskset or a cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_processes(cores: int | None = None) -> int:
    """The most worker processes or threads a flag may ask for: twice the cores, at least 8 (more
    only queue behind each other; a few over the cores still serve, as tests on 2 cores do)."""
    return max(8, 2 * (cores or usable_cores()))


def memory_limit() -> tuple[int, str]:
    """(bytes, what bounds them): this machine's memory, or its cgroup's limit where lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_memory_limit()
    if limit is not None and limit < total:
        return limit, f"this cgroup's memory limit ({format_size(limit)})"
    return total, f"this machine's memory ({format_size(total)})"


def shm_size() -> int | None:
    """Bytes the /dev/shm file system holds in all (its size, not what is free now: a restarted
    pool daemon frees its killed predecessor's segment before it allocates); None without one
    (the daemon then says so when it allocates)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def listen_address(text: str) -> str:
    """argparse type of a store's --listen: tcp://HOST:PORT with PORT 1-65535 or *."""
    host, colon, port = text[len("tcp://"):].rpartition(":")
    if not text.startswith("tcp://") or not colon or not host or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an address: expected {_LISTEN_FORM}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"{text!r}: an IPv6 host goes in brackets, e.g. "
                                         f"tcp://[{host}]:{port}")
    if port != "*" and not (_PORT.fullmatch(port) and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"port {port!r} of {text!r} is not a port: give 1-65535, "
                                         f"or * for a free one")
    return text


def store_address(text: str) -> str:
    """argparse type of a store's address to connect to: tcp://HOST:PORT, PORT 1-65535."""
    listen_address(text)
    if text.endswith(":*"):
        raise argparse.ArgumentTypeError(f"{text!r} names no port: give the one the store "
                                         f"printed when it started (1-65535)")
    return text


def process_count(text: str) -> int:
    """argparse type of --workers and --io-threads: 1 up to max_processes() on this machine."""
    value = int(text) if re.fullmatch(r"\s*[0-9]+\s*", text) else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    cores, most = usable_cores(), max_processes()
    if value > most:
        raise argparse.ArgumentTypeError(f"{value} is too many for {cores} cores: at most "
                                         f"{most} here (twice the cores, at least 8)")
    return value


def memory_size(holds: str, *, in_shm: bool = False) -> Callable[[str], int]:
    """argparse type of a size this machine must be able to hold in memory (`holds`: what lives
    there, for the message); `in_shm`: also in /dev/shm."""

    def check(text: str) -> int:
        try:
            size = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        limit, bound = memory_limit()
        if size > limit:
            raise argparse.ArgumentTypeError(f"{text} is more than {bound}, where {holds} live")
        shm = shm_size() if in_shm else None
        if shm is not None and size > shm:
            raise argparse.ArgumentTypeError(
                f"{text} is more than {SHM_DIR} holds ({format_size(shm)}), where {holds} live: "
                f"give less, or enlarge {SHM_DIR} (docker --shm-size)")
        return size

    return check


def slot_size(text: str) -> int:
    """argparse type of a pool's --slot-bytes: a whole number of 4 KiB pages."""
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size % PAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text} ({size} B) is not a multiple of 4 KiB: engines round each rank's block up to "
            f"4 KiB pages, so a slot is whole pages (e.g. 640KiB, 4MiB; at least an engine's "
            f"block x its ranks)")
    return size


def _cgroup_memory_limit() -> int | None:
    """The tightest memory limit of this process's cgroups (v2 memory.max, v1
    memory.limit_in_bytes, up the path); None where none is set."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            root, limit_file = _CGROUP, "memory.max"
        elif "memory" in controllers.split(","):
            root, limit_file = _CGROUP / "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        # The namespace may hide our path (we see our own cgroup as the root): try both.
        for directory in {*(root / p for p in [rel, *rel.parents]), root}:
            try:
                text = (directory / limit_file).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < _NO_LIMIT:
                limits.append(int(text))
    return min(limits, default=None)
