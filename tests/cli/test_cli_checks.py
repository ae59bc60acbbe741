"""Every value a `kvconnector pool serve` / `store serve` line asks of this machine is checked
before anything starts: one line naming the bad value and what is accepted, exit status 2.

The store's checks run in a real process (`python -m kvconnector.cli.store`, torch-free: well
under a second each); the pool's in this process (the pool's command imports torch), with the
pool's socket directory a temporary one, so what a check left behind can be seen.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnector.cli import build_parser, checks, main
from kvconnector.cli.units import format_size

STORE = [sys.executable, "-m", "kvconnector.cli.store", "store"]


def store_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*STORE, *argv], capture_output=True, text=True, timeout=60)


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # usage errors exit through the parser
        return int(exc.code or 0)


def one_line(err: str) -> str:
    """The one line an error printed (and nothing else: no usage block, no traceback)."""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(("listen", "said"), [
    ("tcp://127.0.0.1:99999", "port '99999' of 'tcp://127.0.0.1:99999' is not a port: give "
                              "1-65535, or * for a free one"),
    ("tcp://127.0.0.1:0", "port '0'"),
    ("tcp://127.0.0.1:http", "port 'http'"),
    ("tcp://127.0.0.1:-1", "port '-1'"),
    ("tcp://127.0.0.1", "'tcp://127.0.0.1' is not an address: expected tcp://HOST:PORT"),
    ("127.0.0.1:7701", "'127.0.0.1:7701' is not an address"),
    ("ipc:///tmp/store", "is not an address"),
    ("tcp://::1:7701", "an IPv6 host goes in brackets, e.g. tcp://[::1]:7701"),
])
def test_a_listen_address_off_form_or_range_is_refused_before_binding(listen: str,
                                                                      said: str) -> None:
    done = store_cli("serve", "--listen", listen, "--capacity", "1MiB", "--security", "none")
    assert done.returncode == 2 and done.stdout == ""  # nothing bound: no "listening on"
    line = one_line(done.stderr)
    assert line.startswith("python -m kvconnector.cli.store store serve: error: argument "
                           "--listen: ") and said in line


def test_the_readme_store_command_without_security_says_which_modes_exist() -> None:
    done = store_cli("serve", "--listen", "tcp://127.0.0.1:7701", "--capacity", "1GiB")
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done.stderr)
    assert line.startswith("kvconnector store serve: error: --security is required: ")
    for told in ("secret (a shared secret: --secret-file FILE", "curve (encrypted: "
                 "--curve-key-pair NAME.key_secret --curve-clients DIR)", "none (loopback only)"):
        assert told in line
    done = store_cli("stats", "tcp://127.0.0.1:7701")
    assert done.returncode == 2
    assert "--curve-server-key NAME.key" in one_line(done.stderr)


def test_worker_and_thread_counts_are_bounded_by_the_cores(
        capsys: pytest.CaptureFixture[str]) -> None:
    most = checks.max_processes()
    assert most == max(8, 2 * checks.usable_cores())
    done = store_cli("serve", "--workers", "1000", "--capacity", "1MiB", "--security", "none")
    assert done.returncode == 2 and done.stdout == ""  # no worker spawned, nothing bound
    assert (f"argument --workers: 1000 is too many for {checks.usable_cores()} cores: at most "
            f"{most} here (twice the cores, at least 8)") in one_line(done.stderr)
    for flag, count, said in (("--io-threads", "1000", "1000 is too many"),
                              ("--io-threads", str(most + 1), f"at most {most} here"),
                              ("--workers", "0", "expected an int >= 1, got '0'"),
                              ("--io-threads", "two", "expected an int >= 1, got 'two'")):
        assert exit_code(["store", "serve", flag, count, "--capacity", "1MiB"]) == 2
        assert f"argument {flag}: " in (line := one_line(capsys.readouterr().err)) and said in line
    # The bound itself is accepted (a few over the cores still serve: CI runs 3 on 2 cores).
    args = build_parser().parse_args(["store", "serve", "--workers", str(most), "--io-threads",
                                      str(most), "--capacity", "1MiB"])
    assert (args.workers, args.io_threads) == (most, most)


def test_a_capacity_beyond_this_machines_memory_is_refused() -> None:
    limit, bound = checks.memory_limit()
    assert limit > 0 and format_size(limit) in bound
    done = store_cli("serve", "--capacity", "5000TiB", "--security", "none")
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done.stderr)
    assert f"argument --capacity: 5000TiB is more than {bound}, where the store's blocks" in line
    done = store_cli("serve", "--capacity", "lots", "--security", "none")
    assert "not a size: 'lots'" in one_line(done.stderr)


def test_the_pool_refuses_a_slot_not_whole_pages(capsys: pytest.CaptureFixture[str]) -> None:
    for slot in ("3", "5000", "2.5KiB"):
        assert exit_code(["pool", "serve", "--name", "p", "--capacity", "64MiB", "--slot-bytes",
                          slot]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"kvconnector pool serve: error: argument --slot-bytes: {slot} (")
        assert "is not a multiple of 4 KiB" in line
    args = build_parser().parse_args(["pool", "serve", "--name", "p", "--capacity", "64MiB",
                                      "--slot-bytes", "640KiB"])
    assert args.slot_bytes == 640 << 10  # Llama-70B TP 8's block: pages, not a power of two


def test_a_pool_capacity_under_one_slot_is_answered_in_user_terms(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the pool's socket would go here
    assert exit_code(["pool", "serve", "--name", "p", "--capacity", "1MiB", "--slot-bytes",
                      "2MiB"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == ("kvconnector pool serve: error: --capacity 1 MiB holds no slot of "
                    "--slot-bytes 2 MiB: the pool holds capacity / slot-bytes slots, so give a "
                    "capacity of at least one slot")
    assert list(tmp_path.iterdir()) == []  # refused before the daemon made its directory


def test_a_pool_capacity_beyond_memory_or_dev_shm_is_refused(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert exit_code(["pool", "serve", "--name", "p", "--capacity", "5000TiB", "--slot-bytes",
                      "4MiB"]) == 2
    assert "argument --capacity: 5000TiB is more than this" in one_line(capsys.readouterr().err)
    monkeypatch.setattr(checks, "shm_size", lambda: 64 << 20)  # a container's small /dev/shm
    assert exit_code(["pool", "serve", "--name", "p", "--capacity", "65MiB", "--slot-bytes",
                      "4MiB"]) == 2
    line = one_line(capsys.readouterr().err)
    assert ("argument --capacity: 65MiB is more than /dev/shm holds (64 MiB), where the pool's "
            "slots live: give less, or enlarge /dev/shm (docker --shm-size)") in line
    assert exit_code(["pool", "serve", "--name", "bad name", "--capacity", "64MiB",
                      "--slot-bytes", "4MiB"]) == 2
    assert "argument --name: pool name must be" in one_line(capsys.readouterr().err)


def test_the_checks_are_argparse_types_naming_the_value() -> None:
    assert checks.listen_address("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"
    assert checks.listen_address("tcp://[::1]:65535") == "tcp://[::1]:65535"
    assert checks.store_address("tcp://10.0.0.5:7701") == "tcp://10.0.0.5:7701"
    with pytest.raises(argparse.ArgumentTypeError, match="names no port"):
        checks.store_address("tcp://10.0.0.5:*")
    with pytest.raises(argparse.ArgumentTypeError, match="'65536'"):
        checks.listen_address("tcp://127.0.0.1:65536")
    assert checks.slot_size("4KiB") == 4096 and checks.slot_size("2MiB") == 2 << 20
    assert [format_size(n) for n in (3, 4096, 640 << 10, (23 << 30) + (1 << 29))] == [
        "3 B", "4 KiB", "640 KiB", "23.5 GiB"]


def test_version() -> None:
    done = subprocess.run([sys.executable, "-m", "kvconnector.cli", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"kvconnector {importlib.metadata.version('kvconnector')}\n"
