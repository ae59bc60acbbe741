"""`kv_connector_extra_config` of the vLLM connector, parsed and checked (no vLLM imports)."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS
from kvconnector.offload.disk_tier import WRITE_POLICIES, DiskSettings
from kvconnector.offload.remote_tier import (
    SECURITY_CHOICES,
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
ERROR_PREFIX = "CrossLayerOffloadConnector kv_connector_extra_config: "


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
    def parse(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        """The options, every key and value checked; a bad one is a one-line ValueError naming
        the key, what it got and what it accepts (vLLM shows it as the engine's start-up error).
        """
        try:
            return cls._parse(extra)
        except ValueError as exc:  # also those of make_security, check_name, make_redis_auth
            raise ValueError(f"{ERROR_PREFIX}{exc}") from None

    @classmethod
    def _parse(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        if not isinstance(extra, Mapping):
            raise ValueError(f"must be a JSON object of keys, got {_show(extra)}")
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = [key for key in extra if key not in defaults]
        if unknown:
            raise ValueError(_unknown_keys(unknown, list(defaults)))
        if (extra.get("cpu_bytes") is None) == (extra.get("pool") is None):
            raise ValueError("needs exactly one of 'cpu_bytes' (host pool bytes per worker, "
                             "e.g. 68719476736 for 64 GiB) and 'pool' (a shared pool's name), "
                             f"got {_show(extra.get('cpu_bytes'))} and {_show(extra.get('pool'))}")
        for key, value in extra.items():
            if value is not None or defaults[key] is not None:  # null: an optional key unset
                _check_value(key, value)
        options = cls(**extra)
        if options.cpu_bytes is not None and options.cpu_bytes > _host_memory_bytes():
            raise ValueError(f"cpu_bytes {options.cpu_bytes} ({_gib(options.cpu_bytes)}) is more "
                             f"than this host's memory ({_gib(_host_memory_bytes())}): each "
                             f"worker's pool is held in RAM")
        if options.pool is not None:
            check_name(options.pool)
            if options.remote_only:
                raise ValueError("remote_only drops the host tier; 'pool' is one: give one of "
                                 "them")
        if options.remote_url is None:
            remote_keys = sorted(k for k, v in extra.items()
                                 if k.startswith("remote_") and v is not None)
            if remote_keys:
                raise ValueError(f"{remote_keys} given without remote_url")
        else:
            options.remote()  # checks the security keys
        if options.disk_path is None:
            disk_keys = sorted(k for k, v in extra.items()
                               if k.startswith("disk_") and v is not None)
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
            for key in zmq_keys:  # read when the first client connects: named at start-up
                _check_readable_file(key, getattr(self, key))
            credentials = make_security(self.remote_url, self.remote_security,
                                        self.remote_secret_file, self.remote_curve_key_pair,
                                        self.remote_curve_server_key)
        return RemoteSettings(self.remote_url, credentials, float(self.remote_lookup_deadline_s),
                              float(self.remote_timeout_s), self.remote_only)


# What each key takes, checked before any key is used (disk_path, disk_bytes and pool by disk()
# and check_name, with messages of their own).
_BYTES_KEYS = ("cpu_bytes", "max_store_bytes")
_SECONDS_KEYS = ("remote_lookup_deadline_s", "remote_timeout_s")
_CHOICE_KEYS = {"eviction": EVICTION_CHOICES, "layout": LAYOUT_CHOICES, "copy_backend": BACKENDS,
                "remote_security": SECURITY_CHOICES, "disk_write_policy": WRITE_POLICIES}
_FLAG_KEYS = ("remote_only",)
_TEXT_KEYS = ("remote_url", "remote_secret_file", "remote_curve_key_pair",
              "remote_curve_server_key", "remote_redis_user", "remote_redis_password_file",
              "remote_redis_ca_file")
_SHOWN_CHARS = 80  # of a bad value, in an error


def _check_value(key: str, value: Any) -> None:
    """ValueError when `value` is not of the kind `key` takes."""
    if key in _BYTES_KEYS and (isinstance(value, bool) or not isinstance(value, int)
                               or value <= 0):
        raise ValueError(f"{key} must be a positive integer of bytes, got {_show(value)}")
    if key in _SECONDS_KEYS and (isinstance(value, bool) or not isinstance(value, int | float)
                                 or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{key} must be a positive number of seconds, got {_show(value)}")
    if key in _FLAG_KEYS and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {_show(value)}")
    if key in _TEXT_KEYS and (not isinstance(value, str) or not value):
        raise ValueError(f"{key} must be a non-empty string, got {_show(value)}")
    choices = _CHOICE_KEYS.get(key)
    if choices is not None and (not isinstance(value, str) or value not in choices):
        raise ValueError(f"{key} must be one of {choices}, got {_show(value)}"
                         f"{_did_you_mean(value, choices)}")


def _unknown_keys(unknown: list[Any], known: list[str]) -> str:
    """One line: each unknown key with the known key it most resembles, then the known keys."""
    named = ", ".join(f"{_show(key)}{_did_you_mean(key, known)}" for key in unknown)
    return (f"unknown key{'s' if len(unknown) > 1 else ''} {named}; accepted keys: "
            f"{', '.join(known)}")


def _did_you_mean(given: Any, choices: tuple[str, ...] | list[str]) -> str:
    """' (did you mean 'x'?)' for the choice closest to `given` (case aside), else ''."""
    if not isinstance(given, str) or len(given) > _SHOWN_CHARS:
        return ""
    folded = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(given.lower(), list(folded), n=1, cutoff=0.6)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""


def _show(value: Any) -> str:
    """repr(value), at most about _SHOWN_CHARS characters (a config may carry a huge value)."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"


def _check_readable_file(key: str, path: str | None) -> None:
    if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        raise ValueError(f"{key} {_show(path)} is not a readable file")


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"
