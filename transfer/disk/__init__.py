"""The disk tier: blocks below the host pool, in one O_DIRECT slab file per rank and namespace.

slab: the file format (slots of block + footer, the footer naming key and checksum) and the
blocking reads and writes of one slot; io: threads that run many of them at once, from and into
pool slots, without blocking the caller.
"""
