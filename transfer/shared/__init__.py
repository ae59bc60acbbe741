"""The shared host pool: one named, pinned shared-memory pool per host, for every engine on it.

A daemon (`kvconnector pool serve`, daemon.py) owns the pool's segment and its block index;
engines map the segment and copy blocks by DMA straight between their caches and its slots; only
metadata goes over a unix socket (protocol.py, client.py).
"""
