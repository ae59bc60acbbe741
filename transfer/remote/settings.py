"""The remote tier's settings: the store's URL and its credentials, checked."""

from __future__ import annotations

from dataclasses import dataclass

from transfer.remote.factory import REDIS_SCHEMES
from transfer.remote.redis.values import RedisAuth, RedisURL
from transfer.remote.store.security import Security, require_loopback, tcp_host

SECURITY_CHOICES = ("none", "secret", "curve")


@dataclass(frozen=True)
class RemoteSettings:
    """The remote tier's options, checked (transfer/remote/tier.py)."""

    url: str
    credentials: Security | RedisAuth  # Security for tcp://, RedisAuth for redis(s)://
    lookup_deadline_s: float
    timeout_s: float
    only: bool


def is_redis_url(url: str) -> bool:
    return url.partition("://")[0] in REDIS_SCHEMES


def make_redis_auth(url: str, user: str | None, password_file: str | None,
                    ca_file: str | None) -> RedisAuth:
    """RedisAuth for a redis(s):// URL; without a password (file or environment) the URL must
    be loopback. ValueError names the bad value."""
    parsed = RedisURL.parse(url)
    if ca_file is not None and not parsed.tls:
        raise ValueError(f"remote_redis_ca_file is for rediss:// (TLS) URLs, got {url!r}")
    auth = RedisAuth.from_sources(user, password_file, ca_file)
    if auth.password is None and not parsed.loopback:
        raise ValueError(f"Redis without a password is allowed only on loopback; give "
                         f"remote_redis_password_file for {url!r}")
    return auth


def make_security(url: str, mode: str, secret_file: str | None, curve_key_pair: str | None,
                  curve_server_key: str | None) -> Security:
    """The client Security for `remote_security`; ValueError names the missing key."""
    tcp_host(url)
    if mode == "none":
        require_loopback(url, "remote_security 'none'")
        return Security.none()
    if mode == "secret":
        if not secret_file:
            raise ValueError("remote_security 'secret' needs remote_secret_file")
        return Security.shared_secret(secret_file)
    if mode == "curve":
        if not (curve_key_pair and curve_server_key):
            raise ValueError("remote_security 'curve' needs remote_curve_key_pair (this "
                             "client's .key_secret file) and remote_curve_server_key")
        return Security.curve_client(curve_key_pair, curve_server_key)
    raise ValueError(f"remote_security must be one of {SECURITY_CHOICES}, got {mode!r}")


