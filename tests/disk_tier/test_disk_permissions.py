"""A disk tier directory this user may not read is a DiskError naming it (as slab.py documents),
never a raw PermissionError out of the restart scan or the slab's opening.

As root (CI runs so) permissions do not bind, so the checks run in a forked child that drops to
the `nobody` uid first; the directory sits in a world-searchable one, so the child reaches it
and is refused by its own mode (000) alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from disk_helpers import NS_DIGEST

from transfer.disk.planner import restored_blocks
from transfer.disk.slab import SlabFile

NOBODY = 65534


@pytest.fixture
def locked() -> Iterator[Path]:
    """A directory of mode 000 inside a world-searchable one (the path lookup is refused before
    any file system question, O_DIRECT included, comes up)."""
    base = Path(tempfile.mkdtemp(prefix="kvconnector-locked-"))
    directory = base / "disk"
    try:
        base.chmod(0o755)
        directory.mkdir(mode=0)
        yield directory
    finally:
        directory.chmod(0o700)
        shutil.rmtree(base)


def outcome(call: Callable[[], object]) -> str:
    """What `call` did, as this user or, as root, in a child as `nobody`: "returned ..." or the
    exception's type and message."""
    if os.geteuid() != 0:
        return _run(call)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, report, exit without running pytest's teardown
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, _run(call).encode()[:4096])
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    return said


def _run(call: Callable[[], object]) -> str:
    try:
        return f"returned {call()!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_the_restart_scan_of_a_directory_it_may_not_read_is_a_disk_error(locked: Path) -> None:
    said = outcome(lambda: restored_blocks(locked, NS_DIGEST, [NS_DIGEST], 4))
    assert said.startswith(f"DiskError: cannot look for {locked}/{NS_DIGEST.hex()}.slab: "), said
    assert "Permission denied" in said


def test_opening_a_slab_in_a_directory_it_may_not_read_is_a_disk_error(locked: Path) -> None:
    said = outcome(lambda: SlabFile(locked, NS_DIGEST, 4096, 4))
    assert said.startswith(f"DiskError: cannot open {locked}/{NS_DIGEST.hex()}.slab: "), said
    assert "Permission denied" in said
