"""A remote backend (transfer.remote.backend) on a background thread: every call returns a
Future at once.

For callers that must not block (vLLM's scheduler asks for hits every step): submit, then look
at `future.done()` on later steps. Calls run one after another in submission order, so give each
role its own instance (lookups on the scheduler, loads and saves on the worker): a lookup queued
behind a long put waits for it. A deadline counts from submission and bounds each reply wait
of the call (a lookup of up to 1024 keys is one request); a call still queued at its deadline
fails with StoreError without being sent. Until a put's or get's future is done, the
thread reads or writes those pool slots.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from transfer.remote.backend import RemoteBackend, TransferResult
from transfer.remote.factory import open_backend
from transfer.remote.store.connection import StoreError

_Job = tuple[Future, float | None, str, tuple[Any, ...]]


class AsyncRemoteClient:
    """Same arguments as open_backend (URL, credentials, options); construction errors
    (ValueError) raise here."""

    def __init__(self, url: str, credentials: Any, **client_options: Any) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        ready: Future[RemoteBackend] = Future()
        self._thread = threading.Thread(target=self._run, args=(url, credentials, client_options,
                                                                ready),
                                        name="kvconnector-remote-client", daemon=True)
        self._thread.start()
        self._client = ready.result()  # read-only use from other threads: checks, timeout_s

    def put(self, keys: Sequence[bytes], slots: Sequence[int], *,
            deadline_s: float | None = None) -> Future[TransferResult]:
        keys, slots = self._client.check_transfer(keys, slots, distinct_slots=False)
        return self._submit("put", (keys, slots), deadline_s)

    def get(self, keys: Sequence[bytes], slots: Sequence[int], *,
            deadline_s: float | None = None) -> Future[TransferResult]:
        keys, slots = self._client.check_transfer(keys, slots, distinct_slots=True)
        return self._submit("get", (keys, slots), deadline_s)

    def lookup(self, keys: Sequence[bytes], *, deadline_s: float | None = None) -> Future[int]:
        """Future of the longest stored prefix of `keys` (StoreError on timeout or failure)."""
        return self._submit("lookup", (self._client.check_keys(keys),), deadline_s)

    def exists(self, keys: Sequence[bytes], *,
               deadline_s: float | None = None) -> Future[list[bool]]:
        return self._submit("exists", (self._client.check_keys(keys),), deadline_s)

    def delete(self, keys: Sequence[bytes], *,
               deadline_s: float | None = None) -> Future[list[bool]]:
        return self._submit("delete", (self._client.check_keys(keys),), deadline_s)

    def stats(self, *, deadline_s: float | None = None) -> Future[dict[str, Any]]:
        return self._submit("stats", (), deadline_s)

    def close(self, drop_queued: bool = False) -> None:
        """Finish the queued calls, then close the connection. With `drop_queued`, the calls not
        yet started are cancelled instead (lookups nobody will read: against a store that went
        away each would wait out its deadline); the one running ends within its own."""
        if not self._closed:
            self._closed = True
            while drop_queued:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            self._jobs.put(None)
            self._thread.join()

    def __enter__(self) -> AsyncRemoteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, method: str, args: tuple[Any, ...],
                deadline_s: float | None) -> Future[Any]:
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s!r}")
        if self._closed:
            raise ValueError("this AsyncRemoteClient is closed")
        future: Future[Any] = Future()
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._jobs.put((future, deadline, method, args))
        return future

    def _run(self, url: str, credentials: Any, options: dict[str, Any],
             ready: Future[RemoteBackend]) -> None:
        try:
            client = open_backend(url, credentials, **options)
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(client)
        try:
            while (job := self._jobs.get()) is not None:
                future, deadline, method, args = job
                if not future.set_running_or_notify_cancel():
                    continue
                timeout = client.timeout_s if deadline is None else deadline - time.monotonic()
                if timeout <= 0:
                    future.set_exception(StoreError("the deadline passed before the request "
                                                    "could be sent"))
                    continue
                try:
                    future.set_result(getattr(client, method)(*args, timeout_s=timeout))
                except BaseException as exc:  # the caller sees it through the future
                    future.set_exception(exc)
        finally:
            client.close()
