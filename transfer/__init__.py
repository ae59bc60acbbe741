"""transfer: the host block pool, block index, copy backends and remote store."""
