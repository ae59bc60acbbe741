"""A Redis Cluster (or Valkey) as the remote store.

- backend: `RedisClusterBackend`, the remote backend for `redis://` and `rediss://` URLs;
- values: the value format (header, checksum) and URLs/auth; wire: RESP pipelines on raw sockets;
- lanes: per-node lanes of pipelines.
"""
