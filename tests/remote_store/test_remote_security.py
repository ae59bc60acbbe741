"""CURVE and shared-secret stores admit the right peers and refuse the rest before any block."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from store_peers import RawPeer

from kvconnector.servers.store import StoreProcess
from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store.client import StoreClient
from transfer.remote.store.protocol import Op, encode_request
from transfer.remote.store.security import Security

BLOCK = 64 << 10
NS = Namespace("model-a", "bfloat16", 16, "BLNHC")
KEYS = NS.keys([b"secure-%d" % i for i in range(4)])
REFUSED = "refused this client's credentials"
HANDSHAKE = "security handshake with the store"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("certs")
    for name in ("server", "client", "intruder"):
        zmq.auth.create_certificates(base, name)
    (base / "clients").mkdir()
    shutil.copy(base / "client.key", base / "clients")
    (base / "secret").write_text("correct horse battery staple\n")
    (base / "wrong-secret").write_text("correct horse battery stapler\n")
    return base


@pytest.fixture(scope="module")
def curve_store(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[StoreProcess]:
    args = ("--security", "curve", "--curve-key-pair", str(certs / "server.key_secret"),
            "--curve-clients", str(certs / "clients"))
    with StoreProcess(tmp_path_factory.mktemp("curve") / "store.log", capacity="16MiB",
                      security_args=args) as proc:
        yield proc


@pytest.fixture(scope="module")
def secret_store(tmp_path_factory: pytest.TempPathFactory,
                 certs: Path) -> Iterator[StoreProcess]:
    args = ("--security", "secret", "--secret-file", str(certs / "secret"))
    with StoreProcess(tmp_path_factory.mktemp("secret") / "store.log", capacity="16MiB",
                      security_args=args) as proc:
        yield proc


def _pool(seed: int, block: int = BLOCK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (4, block), dtype=torch.uint8, generator=generator)


def _round_trip(url: str, security: Security) -> None:
    # 2 MiB blocks: larger than the header limit, so the frame limit is set by the blocks and
    # must leave room for CURVE's framing
    written, read = _pool(1, 2 << 20), torch.zeros((4, 2 << 20), dtype=torch.uint8)
    with StoreClient(url, security, namespace=NS, pool=written) as writer:
        assert writer.put(KEYS, range(4)).all_ok
    with StoreClient(url, security, namespace=NS, pool=read) as reader:
        assert reader.get(KEYS, [3, 2, 1, 0]).all_ok
    assert torch.equal(read.flip(0), written)


def _refused(url: str, security: Security, reason: str, timeout_s: float = 5.0) -> None:
    """A refused client's put and get fail on every block and its pool stays untouched."""
    keys = NS.keys([b"intruder-%d" % i for i in range(4)])
    pool = _pool(2)
    with StoreClient(url, security, namespace=NS, pool=pool, timeout_s=timeout_s) as client:
        put = client.put(keys, range(4))
        get = client.get(KEYS, range(4))
    for result in (put, get):
        assert result.statuses == (BlockStatus.FAILED,) * 4
        assert all(reason in error for error in result.errors), result.errors
    assert torch.equal(pool, _pool(2))


def _raw_put_is_never_served(url: str, security: Security) -> None:
    """A bare DEALER with bad credentials queues a put; the store never sees it."""
    key = NS.key(b"raw-intruder")
    block = bytes(BLOCK)
    peer = RawPeer(url, security)
    try:
        header = encode_request(1, Op.PUT, NS.digest, [key], [BLOCK], [block_checksum(block, key)])
        assert peer.request([header, block], timeout_s=1.0) is None
    finally:
        peer.close()


def _stats(url: str, security: Security) -> dict[str, int]:
    with StoreClient(url, security) as client:
        return client.stats()


def test_curve(curve_store: StoreProcess, certs: Path) -> None:
    good = Security.curve_client(certs / "client.key_secret", certs / "server.key")
    _round_trip(curve_store.url, good)
    before = _stats(curve_store.url, good)
    assert before["security"] == "curve"

    intruder = Security.curve_client(certs / "intruder.key_secret", certs / "server.key")
    _refused(curve_store.url, intruder, REFUSED)
    _refused(curve_store.url, Security.none(), HANDSHAKE)
    _refused(curve_store.url, Security.shared_secret(certs / "secret"), HANDSHAKE)
    # trusting the wrong server key: the store cannot read the client's hello
    misled = Security.curve_client(certs / "client.key_secret", certs / "intruder.key")
    _refused(curve_store.url, misled, HANDSHAKE)
    _raw_put_is_never_served(curve_store.url, intruder)

    after = _stats(curve_store.url, good)
    assert after["auth_refused"] >= before["auth_refused"] + 5
    for counter in ("requests_put", "requests_get", "put_blocks", "get_blocks", "blocks"):
        assert after[counter] == before[counter], counter
    with StoreClient(curve_store.url, good, namespace=NS) as client:
        assert client.exists(NS.keys([b"intruder-0", b"raw-intruder"])) == [False, False]


def test_shared_secret(secret_store: StoreProcess, certs: Path) -> None:
    good = Security.shared_secret(certs / "secret")
    _round_trip(secret_store.url, good)
    before = _stats(secret_store.url, good)
    assert before["security"] == "secret"

    wrong = Security.shared_secret(certs / "wrong-secret")
    _refused(secret_store.url, wrong, REFUSED)
    _refused(secret_store.url, Security.none(), HANDSHAKE)
    _raw_put_is_never_served(secret_store.url, wrong)

    after = _stats(secret_store.url, good)
    assert after["auth_refused"] >= before["auth_refused"] + 2
    for counter in ("requests_put", "requests_get", "put_blocks", "get_blocks", "blocks"):
        assert after[counter] == before[counter], counter


def test_settings_are_checked(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only on loopback"):
        StoreClient("tcp://10.1.2.3:5000", Security.none())
    with pytest.raises(ValueError, match="holds no secret key"):
        StoreClient("tcp://127.0.0.1:5000",
                    Security.curve_client(certs / "client.key", certs / "server.key"))
    with pytest.raises(ValueError, match="cannot read secret_file"):
        StoreClient("tcp://127.0.0.1:5000", Security.shared_secret(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="must hold 1..255 bytes"):
        StoreClient("tcp://127.0.0.1:5000", Security.shared_secret(tmp_path / "empty"))
    (tmp_path / "no-keys").mkdir()
    context = zmq.Context()
    try:
        with pytest.raises(ValueError, match="holds no public .key files"):
            Security.curve_server(certs / "server.key_secret", tmp_path / "no-keys").apply_server(
                context, context.socket(zmq.ROUTER), "tcp://127.0.0.1:*")
    finally:
        context.destroy(linger=0)
