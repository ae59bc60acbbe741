"""The shared pool's daemon: owns the segment and the index, answers its clients.

One thread, one `selectors` loop: requests are short (index work only: writers send their
blocks' checksums with the commit, readers check them), so clients are served in turn. Every
client is a unix-socket connection of this uid; its lease goes with the connection
(SharedBlockIndex.release on EOF or any error).

Start: a live daemon of the same name is refused; a stale socket or segment (a killed daemon's)
is removed first. Each start makes a segment with a new name, so an engine that mapped the old
one never mistakes its slots for the new daemon's. Stop (SIGINT/SIGTERM, or `stop()`): the socket
and the segment's name go; engines that mapped it keep their mapping until they unmap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
from pathlib import Path
from typing import Any

import msgpack

from kvconnector.layout.allocator import SHM_DIR, KVBuffer, allocate, unlink_shared
from kvconnector.layout.descriptor import HOST_ALIGNMENT, KVForm, KVLayout
from transfer.shared import protocol as p
from transfer.shared.index import SharedBlockIndex

log = logging.getLogger("kvconnector.pool")


def slot_layout(slot_bytes: int) -> KVLayout:
    """A block-outermost layout of opaque slots of `slot_bytes` (the engines give them meaning)."""
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=slot_bytes, block_size=1,
                    dtype="uint8", form=KVForm.MLA, order="BLNHC", alignment=HOST_ALIGNMENT)


class _Client:
    def __init__(self, sock: socket.socket, client_id: int) -> None:
        self.sock = sock
        self.id = client_id
        self.unpacker = msgpack.Unpacker(max_buffer_size=p.MAX_MESSAGE_BYTES)
        self.greeted = False


class PoolDaemon:
    """Serves pool `name`: `capacity` bytes of `slot_bytes` slots (see module doc)."""

    def __init__(self, name: str, capacity: int, slot_bytes: int, *, policy: str = "lru",
                 directory: Path | None = None) -> None:
        self.name = p.check_name(name)
        self.path = p.socket_path(name, directory)
        self.owner = os.geteuid()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        self._remove_stale()
        segment = p.segment_prefix(name) + secrets.token_hex(8)
        self.buffer: KVBuffer = allocate(slot_layout(slot_bytes), budget_bytes=capacity,
                                         shared_name=segment)
        self.info = p.PoolInfo(segment, self.buffer.num_blocks, slot_bytes)
        self.index = SharedBlockIndex(self.info.num_slots, slot_bytes, policy)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = os.umask(0o177)  # the socket is created 0600
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old_mask)
        self._listener.listen(64)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._clients: dict[int, _Client] = {}
        self._next_id = 0
        self._running = True
        self.refused = 0  # connections of another uid

    def _remove_stale(self) -> None:
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # nobody listens: a killed daemon's
            else:
                raise ValueError(f"a pool daemon already serves {self.name!r} at {self.path}")
            finally:
                probe.close()
        prefix = p.segment_prefix(self.name)
        for entry in os.scandir(SHM_DIR):
            if entry.name.startswith(prefix) and entry.stat().st_uid == self.owner:
                unlink_shared(entry.name)

    # ---- the loop ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while self._running:
                for key, _ in self._selector.select(timeout=0.2):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
        finally:
            self.close()

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._running = False

    def _accept(self) -> None:
        sock, _ = self._listener.accept()
        try:
            p.check_peer(p.peer_uid(sock), self.owner)
        except PermissionError as exc:
            self.refused += 1
            log.warning("pool %s: refused a connection: %s", self.name, exc)
            with contextlib.suppress(OSError):
                sock.sendall(msgpack.packb([False, str(exc)]))
            sock.close()
            return
        sock.settimeout(5.0)  # a client that stops reading its answers is dropped, not waited on
        client = _Client(sock, self._next_id)
        self._next_id += 1
        self._clients[client.id] = client
        self._selector.register(sock, selectors.EVENT_READ, client)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("closed")
            client.unpacker.feed(data)
            for message in client.unpacker:
                self._handle(client, message)
        except (OSError, ValueError, TypeError, IndexError, KeyError,
                msgpack.UnpackException) as exc:
            if not isinstance(exc, ConnectionError):
                log.warning("pool %s: client %d dropped: %s", self.name, client.id, exc)
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        self._selector.unregister(client.sock)
        client.sock.close()
        del self._clients[client.id]
        self.index.release(client.id)

    def _handle(self, client: _Client, message: Any) -> None:
        if not isinstance(message, list) or not message or not isinstance(message[0], str):
            raise ValueError(f"not a message: {message!r:.80}")
        verb, args = message[0], message[1:]
        if not client.greeted and verb != p.HELLO:
            raise ValueError(f"{verb!r} before hello")
        if verb in p.NOTICES:
            self._notice(client.id, verb, args)  # a bad notice drops the client (ValueError)
            return
        if verb not in p.REQUESTS:
            raise ValueError(f"unknown verb {verb!r}")
        try:
            reply = [True, self._request(client, verb, args)]
        except (ValueError, TypeError, IndexError) as exc:
            reply = [False, f"{verb}: {exc}"]
        client.sock.sendall(msgpack.packb(reply))

    def _request(self, client: _Client, verb: str, args: list[Any]) -> Any:
        index = self.index
        if verb == p.HELLO:
            index.open(client.id, args[0], args[1])
            client.greeted = True
            return self.info.as_list()
        if verb == p.LOOKUP:
            return index.lookup(client.id, args[0])
        if verb == p.PREPARE_STORES:
            plans = [index.prepare_store(client.id, keys) for keys in args[0]]
            return [[plan.keys, plan.slots, plan.not_placed, plan.evicted, plan.evicted_slots]
                    for plan in plans]
        if verb == p.PREPARE_LOAD:
            return index.prepare_load(client.id, args[0])
        if verb == p.CHECKSUMS:
            return index.checksums(client.id, args[0])
        return self.stats()

    def _notice(self, client: int, verb: str, args: list[Any]) -> None:
        if verb == p.COMPLETE_STORE:
            self.index.complete_store(client, args[0], args[1], args[2])
        elif verb == p.COMPLETE_LOAD:
            self.index.complete_load(client, args[0])
        elif verb == p.DISCARD:
            self.index.discard(client, args[0])
        else:
            self.index.clear(client)

    def stats(self) -> dict[str, Any]:
        index = self.index.index
        counters = index.stats
        return {"name": self.name, "segment": self.info.segment, "num_slots": index.num_slots,
                "slot_bytes": self.info.slot_bytes, "stored": len(index), "free": index.num_free,
                "clients": len(self._clients), "refused": self.refused,
                "pinned": sum(sum(lease.pins.values()) for lease in self.index.leases.values()),
                "storing": sum(len(lease.storing) for lease in self.index.leases.values()),
                "stores": counters.stores, "failed_stores": counters.failed_stores,
                "evictions": counters.evictions, "hits": counters.hits,
                "misses": counters.misses}

    def close(self) -> None:
        for client in list(self._clients.values()):
            self._drop(client)
        self._selector.close()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.buffer.close(unlink=True)
