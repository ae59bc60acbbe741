"""The remote tier: a shared, authenticated block store over pyzmq + msgpack.

- client: StoreClient (put/get pool blocks, lookup, exists, delete, stats, ping);
- async_client: AsyncStoreClient (the same on a background thread, returning futures);
- server: StoreServer (in-process) and `kvconnector store serve` (cli);
- protocol: the wire format (docs/protocol.md); security: the three modes; store: its memory.
"""

from transfer.remote.async_client import AsyncStoreClient
from transfer.remote.client import StoreClient, TransferResult
from transfer.remote.connection import StoreError
from transfer.remote.protocol import BlockStatus
from transfer.remote.security import Security, SecurityMode
from transfer.remote.server import StoreServer

__all__ = [
    "AsyncStoreClient",
    "BlockStatus",
    "Security",
    "SecurityMode",
    "StoreClient",
    "StoreError",
    "StoreServer",
    "TransferResult",
]
