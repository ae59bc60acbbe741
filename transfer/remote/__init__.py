"""The remote tier: a shared, authenticated block store over pyzmq + msgpack.

- backend: RemoteBackend, the client-side interface, and open_backend (chosen by URL scheme);
- client: StoreClient, the backend of our store (put/get pool blocks, lookup, exists, delete,
  stats, ping); redis_backend: RedisClusterBackend, the backend of a Redis Cluster;
- async_client: AsyncRemoteClient (any backend on a background thread, returning futures);
- server: StoreServer (in-process) and `kvconnector store serve` (cli);
- protocol: the wire format (docs/protocol.md); security: the three modes; store: its memory.
"""

from transfer.remote.async_client import AsyncRemoteClient
from transfer.remote.backend import RemoteBackend, TransferResult, open_backend
from transfer.remote.client import StoreClient
from transfer.remote.connection import StoreError
from transfer.remote.protocol import BlockStatus
from transfer.remote.security import Security, SecurityMode
from transfer.remote.server import StoreServer

__all__ = [
    "AsyncRemoteClient",
    "BlockStatus",
    "RemoteBackend",
    "Security",
    "SecurityMode",
    "StoreClient",
    "StoreError",
    "StoreServer",
    "TransferResult",
    "open_backend",
]
