"""Which remote backend serves a URL: the one module that knows both implementations.

Neither implementation imports this module, so the base interface (`transfer.remote.backend`)
and the backends stay free of circles; each backend is imported only when its scheme is used.
"""

from __future__ import annotations

from typing import Any

from transfer.remote.backend import RemoteBackend

ZMQ_SCHEMES = ("tcp",)
REDIS_SCHEMES = ("redis", "rediss")


def open_backend(url: str, credentials: Any, **options: Any) -> RemoteBackend:
    """The backend for `url`'s scheme; `options` are namespace, pool, timeout_s and the
    backend's own (ValueError for a scheme we don't speak or credentials of the wrong kind)."""
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme in ZMQ_SCHEMES:
        from transfer.remote.store.client import StoreClient

        return StoreClient(url, credentials, **options)
    if scheme in REDIS_SCHEMES:
        from transfer.remote.redis.backend import RedisClusterBackend

        return RedisClusterBackend(url, credentials, **options)
    raise ValueError(f"remote URL {url!r}: the scheme must be one of "
                     f"{ZMQ_SCHEMES + REDIS_SCHEMES}")
