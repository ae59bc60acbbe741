"""Shared by the disk tier tests: a directory that takes O_DIRECT, pools, seeded block bytes."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from transfer.disk.slab import DiskError, open_direct
from transfer.pool import HostPool

POISON = 0x5A
NS_DIGEST = bytes(range(16))


def direct_dir(path: Path) -> Path:
    """`path`, or a skip when its file system refuses O_DIRECT."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.close(open_direct(path / ".probe", os.O_RDWR | os.O_CREAT))
    except DiskError as exc:
        pytest.skip(f"no O_DIRECT under {path}: {exc}")
    (path / ".probe").unlink()
    return path


def make_pool(block_bytes: int, num_slots: int) -> HostPool:
    """A pageable host pool of `num_slots` page-aligned slots of `block_bytes`."""
    return HostPool.create(num_slots, block_bytes, pinned=False)


def block_data(seed: int, block_bytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=gen)


def key(name: str | int) -> bytes:
    return NS_DIGEST + str(name).encode()


@contextlib.contextmanager
def small_filesystem(image: Path, mount_point: Path, megabytes: int) -> Iterator[Path]:
    """A loop-mounted ext4 of `megabytes` (root only; else a skip)."""
    if os.geteuid() != 0:
        pytest.skip("a loop mount needs root")
    with image.open("wb") as f:
        f.truncate(megabytes << 20)
    mount_point.mkdir()
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot loop-mount a file system here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
