"""The store through real server processes: round trips, sharing, namespaces, eviction, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from store_peers import RawPeer

from kvconnector.cli import store as cli
from kvconnector.layout.allocator import allocate
from kvconnector.layout.descriptor import KVLayout
from kvconnector.servers.store import StoreProcess
from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store import puts as puts_module
from transfer.remote.store.client import StoreClient, StoreError
from transfer.remote.store.protocol import Op, decode_reply, encode_request, reply_statuses
from transfer.remote.store.puts import VERIFY_INLINE_BYTES
from transfer.remote.store.security import Security
from transfer.remote.store.server import StoreServer

BLOCK = 64 << 10  # at pyzmq's copy threshold: frames go zero-copy
NONE = Security.none()
NS_A = Namespace("model-a", "bfloat16", 16, "BLNHC")
NS_B = Namespace("model-b", "bfloat16", 16, "BLNHC")
POISON = 0xA5


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path_factory.mktemp("store") / "store.log", capacity="64MiB") as proc:
        yield proc


def _pool(num_slots: int, seed: int, block: int = BLOCK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_slots, block), dtype=torch.uint8, generator=generator)


def _poisoned(num_slots: int, block: int = BLOCK) -> torch.Tensor:
    return torch.full((num_slots, block), POISON, dtype=torch.uint8)


def test_round_trip_cache_pool_store_fresh_pool_is_bit_exact(store: StoreProcess) -> None:
    # a padded block-major layout: row stride 118784 B > block 115200 B
    layout = KVLayout(num_layers=9, num_kv_heads=5, head_size=40, block_size=16,
                      order="BLNHC")
    source, fresh = allocate(layout, num_blocks=12), allocate(layout, num_blocks=12)
    try:
        source.raw.copy_(torch.randint(0, 256, source.raw.shape, dtype=torch.uint8))
        fresh.raw.fill_(POISON)
        src_pool, dst_pool = source.block_chunks(), fresh.block_chunks()
        assert src_pool.stride(0) > src_pool.shape[1]
        ns = Namespace("round-trip", "bfloat16", 16, layout.describe())
        keys = ns.keys([b"block-%d" % i for i in range(5)])
        src_slots, dst_slots = [9, 2, 7, 0, 4], [1, 10, 3, 6, 8]
        with StoreClient(store.url, NONE, namespace=ns, pool=src_pool) as writer:
            assert writer.put(keys, src_slots).all_ok
        with StoreClient(store.url, NONE, namespace=ns, pool=dst_pool) as reader:
            result = reader.get(keys, dst_slots)
        assert result.statuses == (BlockStatus.OK,) * 5
        assert result.errors == ("",) * 5
        for src, dst in zip(src_slots, dst_slots, strict=True):
            assert torch.equal(dst_pool[dst], src_pool[src])
            for layer in range(layout.num_layers):  # every layer of the block came along
                got, sent = fresh.layer_view(layer)[dst], source.layer_view(layer)[src]
                assert torch.equal(got.view(torch.int16), sent.view(torch.int16))  # NaN-proof
        untouched = sorted(set(range(12)) - set(dst_slots))
        assert bool((dst_pool[untouched] == POISON).all())
    finally:
        source.close()
        fresh.close()


def test_two_clients_share_a_prefix(store: StoreProcess) -> None:
    prefix = NS_A.keys([b"shared-%d" % i for i in range(8)])
    unknown = NS_A.keys([b"never-stored-%d" % i for i in range(2)])
    written = _pool(8, seed=1)
    with StoreClient(store.url, NONE, namespace=NS_A, pool=written) as writer:
        assert writer.put(prefix, range(8)).all_ok
    pool = _poisoned(10)
    with StoreClient(store.url, NONE, namespace=NS_A, pool=pool) as reader:
        assert reader.lookup(prefix + unknown) == 8
        assert reader.lookup(unknown + prefix) == 0
        slots = [9, 8, 7, 6, 5, 4, 3, 2]
        result = reader.get(prefix[:reader.lookup(prefix + unknown)], slots)
    assert result.all_ok
    assert torch.equal(pool[slots], written)
    assert bool((pool[[0, 1]] == POISON).all())


def test_pipelined_batches_and_chunked_key_ops(store: StoreProcess) -> None:
    keys = NS_A.keys([b"pipelined-%d" % i for i in range(40)])
    written = _pool(40, seed=2)
    with StoreClient(store.url, NONE, namespace=NS_A, pool=written, put_batch_bytes=3 * BLOCK,
                     max_in_flight=4) as client:
        assert client.put(keys, range(40)).all_ok  # 14 requests, 4 in flight
        target = _poisoned(40)
        with StoreClient(store.url, NONE, namespace=NS_A, pool=target,
                         get_batch_bytes=3 * BLOCK) as reader:
            assert reader.get(keys, list(reversed(range(40)))).all_ok
        assert torch.equal(target.flip(0), written)
    small = [NS_A.key(b"small-%d" % i) for i in range(1100)]
    with StoreClient(store.url, NONE, namespace=NS_A, pool=_pool(1100, 3, block=512)) as client:
        assert client.put(small[:1030], range(1030)).all_ok
        assert client.lookup(small) == 1030  # spans two lookup requests of 1024 keys
        found = client.exists(small)
        assert found == [True] * 1030 + [False] * 70
        assert client.delete(small[1020:1040]) == [True] * 10 + [False] * 10
        assert client.lookup(small) == 1020


def test_concurrent_clients_each_get_their_own_bytes(store: StoreProcess) -> None:
    def worker(index: int) -> None:
        keys = NS_A.keys([b"concurrent-%d-%d" % (index, i) for i in range(12)])
        written = _pool(12, seed=100 + index)
        target = _poisoned(12)
        with StoreClient(store.url, NONE, namespace=NS_A, pool=written,
                         put_batch_bytes=2 * BLOCK) as writer, \
                StoreClient(store.url, NONE, namespace=NS_A, pool=target,
                            get_batch_bytes=3 * BLOCK) as reader:
            for _ in range(3):
                outcomes[index].append(writer.put(keys, range(12)).all_ok)
                target.fill_(POISON)
                outcomes[index].append(reader.get(keys, range(12)).all_ok
                                       and torch.equal(target, written))

    outcomes: list[list[bool]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert outcomes == [[True] * 6] * 4


def test_in_process_server(tmp_path: Path) -> None:
    server = StoreServer("tcp://127.0.0.1:*", 4 * BLOCK, NONE)
    with server:
        with StoreClient(server.endpoint, NONE, namespace=NS_A, pool=_pool(2, seed=9)) as client:
            assert client.put(NS_A.keys([b"in-process"]), [1]).all_ok
            assert client.ping() == 1
        assert (server.stats()["blocks"], server.stats()["put_blocks"]) == (1, 1)
    with StoreClient(server.endpoint, NONE, timeout_s=0.3) as client, \
            pytest.raises(StoreError, match="no connection"):
        client.ping()  # stopped: nobody listens any more


def test_another_namespace_is_never_served(store: StoreProcess) -> None:
    hashes = [b"ns-%d" % i for i in range(3)]
    with StoreClient(store.url, NONE, namespace=NS_A, pool=_pool(3, seed=4)) as writer:
        assert writer.put(NS_A.keys(hashes), range(3)).all_ok
    pool = _poisoned(3)
    with StoreClient(store.url, NONE, namespace=NS_B, pool=pool) as other:
        assert other.lookup(NS_B.keys(hashes)) == 0
        assert other.exists(NS_B.keys(hashes)) == [False] * 3
        result = other.get(NS_B.keys(hashes), range(3))
        assert result.statuses == (BlockStatus.MISSING,) * 3
        assert bool((pool == POISON).all())
        with pytest.raises(ValueError, match="not in this client's namespace"):
            other.get(NS_A.keys(hashes), range(3))
    peer = RawPeer(store.url)
    try:  # a request naming one namespace may not carry another's keys
        reply = peer.request([encode_request(5, Op.GET, NS_B.digest, NS_A.keys(hashes))])
    finally:
        peer.close()
    assert len(reply) == 1
    decoded = decode_reply(reply[0])
    assert (decoded.request_id, decoded.ok, decoded.code) == (5, False, "namespace")


def test_a_bit_flip_is_caught_by_the_store_on_put(store: StoreProcess) -> None:
    key = NS_A.key(b"flipped")
    block = bytearray(_pool(1, seed=5)[0].numpy().tobytes())
    checksum = block_checksum(block, key)
    block[BLOCK // 2] ^= 0x04  # the bytes change after the writer's checksum
    peer = RawPeer(store.url)
    try:
        header = encode_request(1, Op.PUT, NS_A.digest, [key], [BLOCK], [checksum])
        reply = decode_reply(peer.request([header, bytes(block)])[0])
        assert reply_statuses(reply, 1) == [BlockStatus.CORRUPT]
        with StoreClient(store.url, NONE, namespace=NS_A) as client:
            assert client.exists([key]) == [False]
        block[BLOCK // 2] ^= 0x04
        reply = decode_reply(peer.request([header, bytes(block)])[0])
        assert reply_statuses(reply, 1) == [BlockStatus.OK]
    finally:
        peer.close()


def test_bad_input_is_refused_before_anything_is_stored(store: StoreProcess) -> None:
    keys = NS_A.keys([b"refused-%d" % i for i in range(3)])
    with StoreClient(store.url, NONE, namespace=NS_A, pool=_pool(4, seed=6)) as client:
        before = client.stats()["put_blocks"]
        with pytest.raises(ValueError, match="slot 4 is outside"):
            client.put(keys, [0, 1, 4])
        with pytest.raises(ValueError, match="3 keys but 2 slots"):
            client.put(keys, [0, 1])
        with pytest.raises(ValueError, match="key 1"):
            client.put([keys[0], b"short", keys[2]], [0, 1, 2])
        with pytest.raises(ValueError, match="slot 1 appears twice"):
            client.get(keys, [1, 2, 1])
        assert client.stats()["put_blocks"] == before
        assert client.exists(keys) == [False] * 3
    with pytest.raises(ValueError, match="pool must be"):
        StoreClient(store.url, NONE, namespace=NS_A, pool=torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="no pool"):
        StoreClient(store.url, NONE, namespace=NS_A).get(keys, [0, 1, 2])


def test_capacity_eviction_is_lru(tmp_path: Path) -> None:
    keys = NS_A.keys([b"evict-%d" % i for i in range(15)])
    with StoreProcess(tmp_path / "store.log", capacity=str(10 * BLOCK)) as small, \
            StoreClient(small.url, NONE, namespace=NS_A, pool=_pool(15, seed=7)) as client:
        assert client.put(keys[:10], range(10)).all_ok
        assert client.lookup(keys[:1]) == 1  # block 0 becomes most recently used
        assert client.put(keys[10:], range(10, 15)).all_ok
        assert client.exists(keys) == [True] + [False] * 5 + [True] * 9
        stats = client.stats()
        assert (stats["blocks"], stats["used_bytes"], stats["evictions"]) == (10, 10 * BLOCK, 5)
    with StoreProcess(tmp_path / "tiny.log", capacity=str(BLOCK // 2)) as tiny, \
            StoreClient(tiny.url, NONE, namespace=NS_A, pool=_pool(1, seed=8)) as client:
        result = client.put(keys[:1], [0])
        assert result.statuses == (BlockStatus.FULL,)
        assert "no room" in result.errors[0]


def test_kvconnector_store_commands(tmp_path: Path, store: StoreProcess) -> None:
    with StoreClient(store.url, NONE) as client:
        blocks = client.stats()["blocks"]
    stats = subprocess.run([sys.executable, "-m", "kvconnector.cli", "store", "stats", store.url,
                            "--security", "none"], capture_output=True, text=True, timeout=120,
                           check=True)
    printed = json.loads(stats.stdout)
    assert (printed["blocks"], printed["protocol"], printed["security"]) == (blocks, 1, "none")
    serve = subprocess.Popen([sys.executable, "-m", "kvconnector.cli", "store", "serve",
                              "--capacity", "1MiB", "--security", "none"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = re.search(r"listening on (tcp://127\.0\.0\.1:\d+)", serve.stdout.readline())[1]
        with StoreClient(url, NONE) as client:
            assert client.ping() == 1
            assert client.stats()["capacity_bytes"] == 1 << 20
    finally:
        serve.terminate()
        assert serve.wait(30) == 0
        serve.stdout.close()


def test_serve_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["store", "serve", "--listen", "tcp://0.0.0.0:*", "--capacity", "1MiB",
                     "--security", "none"]) == 2
    assert "only on loopback" in capsys.readouterr().err
    assert cli.main(["store", "serve", "--capacity", "1MiB", "--security", "curve"]) == 2
    assert "needs --curve-key-pair" in capsys.readouterr().err
    assert cli.main(["store", "serve", "--capacity", "1MiB", "--security", "none",
                     "--secret-file", "x"]) == 2
    assert "--secret-file belongs to --security secret" in capsys.readouterr().err


def test_serve_reports_a_port_in_use(store: StoreProcess,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["store", "serve", "--listen", store.url, "--capacity", "1MiB",
                     "--security", "none"]) == 2
    assert "Address already in use" in capsys.readouterr().err


def test_unanswered_request_ids_and_stats_ops(store: StoreProcess) -> None:
    peer = RawPeer(store.url)
    try:
        reply = decode_reply(peer.request([encode_request(2**64 - 1, Op.PING)])[0])
        assert (reply.request_id, reply.ok, reply.fields["protocol"]) == (2**64 - 1, True, 1)
        raw = peer.request([msgpack.packb({"v": 1, "id": 3, "op": "stats"}), b"extra"])
        assert decode_reply(raw[0]).code == "frames"
    finally:
        peer.close()


def _large_put(count: int, seed: int) -> tuple[list[bytes], list[bytes], list[int]]:
    """`count` blocks of half the inline limit each, so a put of 2+ goes to the verifier."""
    size = VERIFY_INLINE_BYTES // 2
    keys = NS_A.keys([b"large-%d-%d" % (seed, i) for i in range(count)])
    blocks = [_pool(1, seed=seed + i, block=size)[0].numpy().tobytes() for i in range(count)]
    return keys, blocks, [block_checksum(b, k) for b, k in zip(blocks, keys, strict=True)]


@pytest.mark.parametrize("verify_threads", [0, 2])
def test_a_corrupt_block_of_a_large_put_is_caught_inline_or_threaded(verify_threads: int) -> None:
    keys, blocks, sums = _large_put(4, seed=20)
    corrupt = bytearray(blocks[2])
    corrupt[len(corrupt) // 3] ^= 0x10  # after the writer's checksum
    with StoreServer("tcp://127.0.0.1:*", 64 << 20, NONE, verify_threads=verify_threads) as srv:
        peer = RawPeer(srv.endpoint)
        try:
            header = encode_request(1, Op.PUT, NS_A.digest, keys, [len(b) for b in blocks], sums)
            reply = decode_reply(peer.request([header, *blocks[:2], bytes(corrupt), blocks[3]])[0])
            assert reply_statuses(reply, 4) == [BlockStatus.OK, BlockStatus.OK,
                                                BlockStatus.CORRUPT, BlockStatus.OK]
            with StoreClient(srv.endpoint, NONE, namespace=NS_A) as client:
                assert client.exists(keys) == [True, True, False, True]
        finally:
            peer.close()
        stats = srv.stats()
        assert (stats["put_blocks"], stats["put_corrupt"], stats["blocks"]) == (3, 1, 3)


def test_threaded_checks_answer_puts_in_arrival_order() -> None:
    keys, blocks, sums = _large_put(8, seed=30)
    size = len(blocks[0])
    with StoreServer("tcp://127.0.0.1:*", 64 << 20, NONE, verify_threads=2) as srv:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 10_000
        sock.connect(srv.endpoint)
        try:  # a large (threaded) put, then a small (inline) one, then a large one
            sock.send_multipart([encode_request(1, Op.PUT, NS_A.digest, keys[:7], [size] * 7,
                                                sums[:7]), *blocks[:7]])
            small = b"x" * 100
            small_key = NS_A.key(b"small")
            sock.send_multipart([encode_request(2, Op.PUT, NS_A.digest, [small_key], [100],
                                                [block_checksum(small, small_key)]), small])
            sock.send_multipart([encode_request(3, Op.PUT, NS_A.digest, keys[6:], [size] * 2,
                                                sums[6:]), *blocks[6:]])
            replies = [decode_reply(sock.recv_multipart()[0]) for _ in range(3)]
        finally:
            sock.close()
        assert [r.request_id for r in replies] == [1, 2, 3]
        assert [len(reply_statuses(r, n)) for r, n in zip(replies, (7, 1, 2), strict=True)] \
            == [7, 1, 2]
        assert all(s is BlockStatus.OK for r, n in zip(replies, (7, 1, 2), strict=True)
                   for s in reply_statuses(r, n))
        stats = srv.stats()
        assert (stats["put_blocks"], stats["put_existing"], stats["blocks"]) == (9, 1, 9)
        pool = torch.zeros((8, size), dtype=torch.uint8)
        with StoreClient(srv.endpoint, NONE, namespace=NS_A, pool=pool) as client:
            assert client.get(keys, range(8)).all_ok
        assert [pool[i].numpy().tobytes() for i in range(8)] == blocks


def test_a_failing_verifier_costs_one_put(monkeypatch: pytest.MonkeyPatch) -> None:
    keys, blocks, sums = _large_put(2, seed=40)

    def broken(*_: object) -> None:
        raise RuntimeError("verifier bug")

    with StoreServer("tcp://127.0.0.1:*", 64 << 20, NONE, verify_threads=2) as srv:
        peer = RawPeer(srv.endpoint)
        try:
            header = encode_request(9, Op.PUT, NS_A.digest, keys, [len(b) for b in blocks], sums)
            with monkeypatch.context() as patch:
                patch.setattr(puts_module, "_check", broken)
                reply = decode_reply(peer.request([header, *blocks])[0])
            assert (reply.request_id, reply.ok, reply.code) == (9, False, "internal")
            reply = decode_reply(peer.request([header, *blocks])[0])  # the store carries on
            assert reply_statuses(reply, 2) == [BlockStatus.OK, BlockStatus.OK]
        finally:
            peer.close()
        assert srv.stats()["internal_errors"] == 1


@pytest.mark.parametrize("threads", [-1, 1.5, True])
def test_verify_threads_must_be_a_count(threads: object) -> None:
    with pytest.raises(ValueError, match="verify_threads"):
        StoreServer("tcp://127.0.0.1:*", 1 << 20, NONE, verify_threads=threads)
