"""The remote tier's worker side: gets into and puts out of this worker's part of the pool's
slots, on AsyncRemoteClient threads (two connections: calls on one run in order, and a load
must not wait behind puts). Every non-OK block fails its op.

Keys: rank r puts and gets under its own rank's namespace (same hash, rank r's digest), since its
bytes differ. Where every TP rank holds the same bytes (MLA's latent cache), all ranks use rank
0's keys and only rank 0 puts (`writes`): one copy in the store instead of one per rank; the
others report their writes done at once.

A get that finds a block damaged in the store (its bytes unlike its checksum, or the wrong size)
deletes it there: the store keeps a key's first block on a later put, so it would fail every
fetch of it, by any engine; once deleted, the block this engine recomputes is put anew.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future

import torch

from transfer.keys import DIGEST_BYTES
from transfer.remote.async_client import AsyncRemoteClient
from transfer.remote.backend import BlockStatus, TransferResult
from transfer.remote.settings import RemoteSettings
from transfer.tier import OpResult, TierOp, TierWorker

_DAMAGED = frozenset({BlockStatus.CORRUPT, BlockStatus.SIZE})


class RemoteFetcher:
    """Gets and puts whole blocks between one worker's pool and the store (worker side).

    `pool`: the worker's (num_slots, block_bytes) uint8 slot rows; `namespace_digest`: this
    rank's namespace (keys from the scheduler are re-keyed to it); `writes`: whether this rank
    puts its stored blocks (False on a rank whose bytes another rank puts under the same keys).
    """

    def __init__(self, settings: RemoteSettings, namespace_digest: bytes,
                 pool: torch.Tensor, writes: bool = True) -> None:
        self.timeout_s = settings.timeout_s
        self.writes = writes
        self._digest = namespace_digest
        # Two connections: calls on one run in order, and a load must not wait behind puts.
        self._getter, self._putter = (
            AsyncRemoteClient(settings.url, settings.credentials, namespace=namespace_digest,
                             pool=pool, timeout_s=settings.timeout_s) for _ in range(2))

    def rekey(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self._digest + key[DIGEST_BYTES:] for key in keys]

    def get(self, keys: Sequence[bytes], slots: Sequence[int]) -> Future[TransferResult]:
        return self._getter.get(self.rekey(keys), slots, deadline_s=self.timeout_s)

    def put(self, keys: Sequence[bytes], slots: Sequence[int]) -> Future[TransferResult]:
        return self._putter.put(self.rekey(keys), slots, deadline_s=self.timeout_s)

    def delete(self, keys: Sequence[bytes]) -> Future[list[bool]]:
        """On the gets' connection: a later get of these keys is sent after it."""
        return self._getter.delete(self.rekey(keys), deadline_s=self.timeout_s)

    def pinned_slots(self) -> frozenset[int]:
        """Slots the transport may still read for a put that timed out (rare). Asked from the
        worker thread while the client thread adds to the set (both backends lock it): a slot
        pinned a moment after this answer is in the next one."""
        return self._putter._client.pinned_slots

    def close(self) -> None:
        self._getter.close()
        self._putter.close()


class RemoteWorker(TierWorker):
    """The store side of one worker: a RemoteFetcher over the bound rows (a new one for each
    new mapping of the pool)."""

    name = "remote"

    def __init__(self, settings: RemoteSettings, namespace_digest: bytes,
                 writes: bool = True) -> None:
        self.settings = settings
        self.digest = namespace_digest
        self.writes = writes
        self._fetcher: RemoteFetcher | None = None
        self._calls: dict[int, tuple[TierOp, Future[TransferResult] | None]] = {}

    def bind(self, rows: torch.Tensor, room: int | None) -> None:
        self.release()
        self._fetcher = RemoteFetcher(self.settings, self.digest, rows, writes=self.writes)

    def release(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None

    def submit(self, op: TierOp) -> None:
        if self._fetcher is None:
            raise RuntimeError(f"remote op {op.op_id} before the pool's rows are bound")
        if not op.is_write:
            self._calls[op.op_id] = (op, self._fetcher.get(op.keys, op.slots))
        elif self.writes:
            # Reported once done: the scheduler keeps the slots pinned until then, so no new
            # store overwrites what zmq still reads.
            self._calls[op.op_id] = (op, self._fetcher.put(op.keys, op.slots))
        else:
            self._calls[op.op_id] = (op, None)  # another rank puts these bytes

    def get_finished(self) -> list[OpResult]:
        out = []
        for op_id, (op, future) in list(self._calls.items()):
            if future is None:
                ok = (True,) * len(op.keys)
            elif not future.done():
                continue
            elif future.cancelled() or future.exception() is not None:
                if op.is_write and self._still_read(op):
                    continue  # a timed-out put zmq still reads: keep the slots reserved
                ok = (False,) * len(op.keys)
            else:
                result = future.result()
                ok = tuple(result.ok)
                if op.is_write and not all(ok) and self._still_read(op):
                    continue
                if not op.is_write:
                    self._delete_damaged(op, result)
            del self._calls[op_id]
            out.append(OpResult(self.name, op_id, ok))
        return out

    def _delete_damaged(self, op: TierOp, result: TransferResult) -> None:
        """Delete the blocks a get found damaged (bytes unlike their checksum, the wrong size):
        the store keeps a key's first block on a later put, so such a block would fail every
        engine's every fetch of it. Not awaited: its future is dropped."""
        damaged = [key for key, status in zip(op.keys, result.statuses, strict=True)
                   if status in _DAMAGED]
        if damaged and self._fetcher is not None:
            self._fetcher.delete(damaged)

    def _still_read(self, op: TierOp) -> bool:
        pinned = self._fetcher.pinned_slots() if self._fetcher is not None else frozenset()
        return any(slot in pinned for slot in op.slots)

    def wait(self, op_ids: Sequence[int] | None = None) -> None:
        for op_id, (_, future) in list(self._calls.items()):
            if future is not None and (op_ids is None or op_id in op_ids):
                with contextlib.suppress(CancelledError):
                    future.exception()  # waits; store calls are bounded by their deadline

    def close(self) -> None:
        self.wait()
        self.release()
