"""Local servers for the bench, the examples and the tests: not part of the connector.

Each starts a real server in child processes on this machine and stops it again:
- child: `ChildServer`, the one start / wait-until-ready / stop / kill loop the others share;
- store: `StoreProcess`, a `kvconnector store serve` process;
- baseline: the store's same-run baseline for the bench (raw pyzmq streams and their server);
- pool: `PoolProcess`, a `kvconnector pool serve` daemon;
- redis_cluster: `LocalRedisCluster`, a Redis Cluster of Debian's redis-server (redis_nodes: its
  processes and configs; certs: a throwaway CA for its TLS mode).

The connector never imports this package; it may import `transfer`, never the other way round.
Nothing is imported here: each module loads its own dependencies (redis-py, zmq) when used.
"""
