"""The remote tier: blocks shared by many engines, over the network.

- backend: the client-side interface every remote backend implements (`RemoteBackend`,
  `TransferResult`, `BlockStatus`, the per-block checksum); factory: `open_backend(url)`;
- async_client: any backend on a background thread, returning futures;
- store/: our block store (pyzmq + msgpack): protocol, server, memory, client, security;
- redis/: a Redis Cluster (or Valkey) as the store: values, wire, lanes, local clusters.
"""
