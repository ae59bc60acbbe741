"""Our remote block store over pyzmq + msgpack (docs/protocol.md).

- protocol: the wire format; connection: one DEALER and its in-flight requests;
- client: `StoreClient`, the remote backend for `tcp://` URLs;
- server: `StoreServer` (a ROUTER thread) over memory: `BlockStore`, its blocks in RAM;
- security: none / shared secret / CURVE via zmq.auth.
"""
