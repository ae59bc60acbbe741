"""`kv_connector_extra_config` of the vLLM connector, parsed and checked (no vLLM imports)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS
from kvconnector.offload.disk_tier import WRITE_POLICIES, DiskSettings
from kvconnector.offload.remote_tier import (
    RemoteSettings,
    is_redis_url,
    make_redis_auth,
    make_security,
)
from transfer.copy.factory import BACKENDS
from transfer.engine import DEFAULT_MAX_STORE_BYTES
from transfer.shared.protocol import check_name

LAYOUT_CHOICES = ("auto", "engine", *BLOCK_MAJOR_ORDERS)
EVICTION_CHOICES = ("lru", "arc")


@dataclass(frozen=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, checked. Unknown keys are refused (a typo would be silent).

    cpu_bytes: host pool bytes per worker (per GPU); slots = cpu_bytes // block bytes.
    pool: instead of cpu_bytes, the name of the host's shared pool (`kvconnector pool serve`):
    every rank of every engine on the host stores into and loads from its slots (exactly one of
    cpu_bytes and pool is required).
    eviction: "lru" or "arc". layout: "auto" (a block-outermost layout the attention backend
    accepts), a block-outermost name, or "engine" (keep vLLM's default: the per-layer path).
    copy_backend: "auto" (on CUDA batched DMA, loads of pages under 28 KiB on 12 SMs), "dma",
    "sm" (every SM) or "thread".
    max_store_bytes: bytes of stores in flight per worker; past it new stores are skipped.
    remote_url: a `kvconnector store serve` URL (tcp://) or a Redis Cluster's seeds
    (redis://[user@]host:port[,host:port...], rediss:// for TLS): the store becomes the second
    tier (lookups past the CPU tier's hits, write-through of every stored block).
    tcp://: remote_security "none" (loopback only), "secret" (remote_secret_file) or "curve"
    (remote_curve_key_pair, remote_curve_server_key). redis(s)://: remote_redis_user (ACL user),
    remote_redis_password_file (else $KVCONNECTOR_REDIS_PASSWORD; none: loopback only),
    remote_redis_ca_file (rediss://). remote_lookup_deadline_s: how long a lookup may keep a request
    waiting; remote_timeout_s: bound of each get and put; remote_only: the host pool only
    stages blocks on their way to and from the store (cpu_bytes sizes it).
    disk_path: a directory on a local drive (O_DIRECT) for the disk tier below the pool, one slab
    file per rank; disk_bytes: its size per worker; disk_write_policy: "evict" (blocks go to disk
    as the pool evicts them) or "through" (every block stored in the pool also goes to disk; the
    only policy with remote_only, whose pool evicts nothing: the disk is then the local tier in
    front of the store). Below a shared `pool`, "evict" writes the blocks this engine's stores
    evict (another engine's evictions are unseen): "through" keeps every block.
    """

    cpu_bytes: int | None = None
    pool: str | None = None
    eviction: str = "lru"
    layout: str = "auto"
    copy_backend: str = "auto"
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES
    remote_url: str | None = None
    remote_security: str = "none"
    remote_secret_file: str | None = None
    remote_curve_key_pair: str | None = None
    remote_curve_server_key: str | None = None
    remote_redis_user: str | None = None
    remote_redis_password_file: str | None = None
    remote_redis_ca_file: str | None = None
    remote_lookup_deadline_s: float = 0.2
    remote_timeout_s: float = 5.0
    remote_only: bool = False
    disk_path: str | None = None
    disk_bytes: int | None = None
    disk_write_policy: str = "evict"

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; known: "
                             f"{sorted(known)}")
        if ("cpu_bytes" in extra) == ("pool" in extra):
            raise ValueError("kv_connector_extra_config needs exactly one of 'cpu_bytes' (host "
                             "pool bytes per worker, e.g. 68719476736 for 64 GiB) and 'pool' "
                             f"(a shared pool's name), got {extra.get('cpu_bytes')!r} and "
                             f"{extra.get('pool')!r}")
        options = cls(**extra)
        if options.pool is not None:
            check_name(options.pool)
            if options.remote_only:
                raise ValueError("remote_only drops the host tier; 'pool' is one: give one of "
                                 "them")
        for name in ("cpu_bytes", "max_store_bytes"):
            value = getattr(options, name)
            if name == "cpu_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer of bytes, got {value!r}")
        for name, choices in (("eviction", EVICTION_CHOICES), ("layout", LAYOUT_CHOICES),
                              ("copy_backend", BACKENDS)):
            if getattr(options, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got "
                                 f"{getattr(options, name)!r}")
        for name in ("remote_lookup_deadline_s", "remote_timeout_s"):
            value = getattr(options, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if options.remote_url is None:
            remote_keys = sorted(k for k in extra if k.startswith("remote_"))
            if remote_keys:
                raise ValueError(f"{remote_keys} given without remote_url")
        else:
            options.remote()  # checks the security keys
        if options.disk_path is None:
            disk_keys = sorted(k for k in extra if k.startswith("disk_"))
            if disk_keys:
                raise ValueError(f"{disk_keys} given without disk_path")
        else:
            options.disk()
            if options.remote_only and options.disk_write_policy != "through":
                # The pool only stages blocks for the store and drops them once put: it never
                # evicts one, so "evict" would write nothing to disk.
                raise ValueError(f"remote_only with disk_path needs disk_write_policy "
                                 f"'through' (every block written to disk as it goes to the "
                                 f"store), got {options.disk_write_policy!r}: with remote_only "
                                 f"the pool evicts nothing")
        return options

    def disk(self) -> DiskSettings | None:
        """The disk tier's settings, or None without disk_path."""
        if self.disk_path is None:
            return None
        if not isinstance(self.disk_path, str) or not self.disk_path:
            raise ValueError(f"disk_path must be a directory path, got {self.disk_path!r}")
        value = self.disk_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"disk_path needs disk_bytes, a positive integer of bytes per "
                             f"worker; got {value!r}")
        if self.disk_write_policy not in WRITE_POLICIES:
            raise ValueError(f"disk_write_policy must be one of {WRITE_POLICIES}, got "
                             f"{self.disk_write_policy!r}")
        return DiskSettings(self.disk_path, value, self.disk_write_policy)

    def remote(self) -> RemoteSettings | None:
        """The remote tier's settings, or None without remote_url."""
        if self.remote_url is None:
            return None
        if not isinstance(self.remote_url, str) or not isinstance(self.remote_only, bool):
            raise ValueError(f"remote_url must be a URL string and remote_only a bool, got "
                             f"{self.remote_url!r}, {self.remote_only!r}")
        redis_keys = ("remote_redis_user", "remote_redis_password_file", "remote_redis_ca_file")
        zmq_keys = ("remote_secret_file", "remote_curve_key_pair", "remote_curve_server_key")
        if is_redis_url(self.remote_url):
            given = [k for k in zmq_keys if getattr(self, k) is not None]
            if given or self.remote_security != "none":
                raise ValueError(f"{given or ['remote_security']} are for tcp:// stores; "
                                 f"{self.remote_url!r} is a Redis URL (use remote_redis_*)")
            credentials = make_redis_auth(self.remote_url, self.remote_redis_user,
                                          self.remote_redis_password_file,
                                          self.remote_redis_ca_file)
        else:
            given = [k for k in redis_keys if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{given} are for redis:// URLs, not {self.remote_url!r}")
            credentials = make_security(self.remote_url, self.remote_security,
                                        self.remote_secret_file, self.remote_curve_key_pair,
                                        self.remote_curve_server_key)
        return RemoteSettings(self.remote_url, credentials, float(self.remote_lookup_deadline_s),
                              float(self.remote_timeout_s), self.remote_only)
