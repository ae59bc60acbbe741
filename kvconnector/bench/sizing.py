"""How much memory the benchmark may take, and how many blocks each case moves.

Limits come from the cgroup (v2 memory.max, v1 memory.limit_in_bytes, the tightest on the path up)
and, finally, from the allocation itself failing; never from MemTotal, which starts low on the
ballooning VMs we run on and grows as memory is used.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 62  # v1 reports "no limit" as a page-rounded 2**63 - 1


class BenchError(Exception):
    """A problem with the request (flags, sizes, memory): one line for the user, exit code 2."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def cgroup_memory_left() -> int | None:
    """Bytes this process's cgroups still allow (limit - usage, tightest ancestor); None if none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    left: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            root, limit_file, usage_file = _CGROUP, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_file, usage_file = _CGROUP / "memory", "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        # The namespace may hide our path (we see our own cgroup as the root): try both.
        for d in {*(root / p for p in [rel, *rel.parents]), root}:
            limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
            if limit is not None and limit < _NO_LIMIT:
                here = max(0, limit - (usage or 0))
                left = here if left is None else min(left, here)
    return left


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def jobs_blocks(capacity: int, requested: int | None, default: int) -> int:
    """Blocks per job: bidirectional runs take two disjoint sets, so 2 x blocks must fit."""
    fits = capacity // 2
    if requested is not None:
        if requested > fits:
            raise ValueError(f"--blocks {requested} needs {2 * requested} blocks per side; the "
                             f"budget holds {capacity}: raise --budget or lower --blocks")
        return requested
    return min(default, fits)


def disjoint_id_sets(rng: random.Random, count: int, capacity: int) -> tuple[list[int], list[int]]:
    """Two disjoint sets of `count` ids in range(capacity), each non-adjacent, random order.

    Even ids for one set, odd for the other: ids within a set differ by at least 2.
    """
    evens, odds = list(range(0, capacity, 2)), list(range(1, capacity, 2))
    if count > len(odds):
        raise ValueError(f"cannot pick two sets of {count} non-adjacent ids from {capacity}")
    return rng.sample(evens, count), rng.sample(odds, count)


def blocks_for_tokens(tokens: int, block_tokens: int) -> int:
    return math.ceil(tokens / block_tokens)
