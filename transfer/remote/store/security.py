"""Who may talk to the store, through pyzmq's own zmq.auth (no crypto of ours).

Three modes, chosen explicitly by both sides:
- "curve": CURVE (encrypted, authenticated). Key pairs are files made by
  `zmq.auth.create_certificates(dir, name)` (`name.key` public, `name.key_secret` both halves).
  The store loads its key pair and a directory of the public keys of the clients it admits;
  a client loads its key pair and the store's public key.
- "secret": a shared secret read from a file, sent as a ZMTP PLAIN password and checked through ZAP
  by zmq.auth's ThreadAuthenticator. Not encrypted: for trusted networks.
- "none": no security, allowed only on loopback.
A refused peer never completes the zmq handshake, so none of its messages reach the store.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "kvconnector-store"
SECRET_USER = "kvconnector"
_LOOPBACK_NAMES = ("localhost",)
_MAX_PLAIN_BYTES = 255  # ZMTP PLAIN carries the password with a one-byte length


class SecurityMode(str, Enum):
    NONE = "none"
    SECRET = "secret"
    CURVE = "curve"


@dataclass(frozen=True)
class Security:
    """One side's security settings; build with the classmethods."""

    mode: SecurityMode
    secret_file: Path | None = None  # secret: a file holding the shared secret
    curve_key_pair: Path | None = None  # curve: this side's `.key_secret` file
    curve_server_key: Path | None = None  # curve, client: the store's public `.key` file
    curve_clients_dir: Path | None = None  # curve, store: the admitted clients' public keys

    @classmethod
    def none(cls) -> Security:
        return cls(SecurityMode.NONE)

    @classmethod
    def shared_secret(cls, secret_file: str | Path) -> Security:
        return cls(SecurityMode.SECRET, secret_file=Path(secret_file))

    @classmethod
    def curve_server(cls, key_pair: str | Path, clients_dir: str | Path) -> Security:
        return cls(SecurityMode.CURVE, curve_key_pair=Path(key_pair),
                   curve_clients_dir=Path(clients_dir))

    @classmethod
    def curve_client(cls, key_pair: str | Path, server_key: str | Path) -> Security:
        return cls(SecurityMode.CURVE, curve_key_pair=Path(key_pair),
                   curve_server_key=Path(server_key))

    def apply_server(self, context: zmq.Context, socket: zmq.Socket,
                     listen: str) -> ThreadAuthenticator | None:
        """Configure a store socket before it binds; returns the authenticator to stop later."""
        if self.mode is SecurityMode.NONE:
            require_loopback(listen, "security mode none")
            # A ZAP domain makes zmq refuse ZMTP 1.0 and 2.0 peers (as the other modes do),
            # whose messages carry no descriptor the store can account them to; with no ZAP
            # handler in the context, ZMTP 3 peers of mechanism NULL are admitted as before.
            socket.zap_domain = ZAP_DOMAIN.encode()
            return None
        if self.mode is SecurityMode.SECRET:
            passwords = {SECRET_USER: _read_secret(self.secret_file)}
        else:
            public, secret = _load_key_pair(self.curve_key_pair)
            clients_dir = _existing(self.curve_clients_dir, "curve_clients_dir", directory=True)
            if not any(clients_dir.glob("*.key")):
                raise ValueError(f"curve clients directory {clients_dir} holds no public .key "
                                 f"files: every client would be refused")
        auth = ThreadAuthenticator(context)
        auth.start()
        socket.zap_domain = ZAP_DOMAIN.encode()
        if self.mode is SecurityMode.SECRET:
            auth.configure_plain(domain=ZAP_DOMAIN, passwords=passwords)
            socket.plain_server = True
        else:
            auth.configure_curve(domain=ZAP_DOMAIN, location=str(clients_dir))
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_server = True
        return auth

    def apply_client(self, socket: zmq.Socket, url: str) -> None:
        """Configure a client socket before it connects."""
        if self.mode is SecurityMode.NONE:
            require_loopback(url, "security mode none")
        elif self.mode is SecurityMode.SECRET:
            socket.plain_username = SECRET_USER.encode()
            socket.plain_password = _read_secret(self.secret_file).encode()
        else:
            public, secret = _load_key_pair(self.curve_key_pair)
            server_key = _existing(self.curve_server_key, "curve_server_key", directory=False)
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_serverkey = zmq.auth.load_certificate(server_key)[0]


def require_loopback(url: str, what: str) -> None:
    """ValueError unless `url` is tcp:// on a loopback address."""
    host = tcp_host(url)
    if host in _LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{what} is allowed only on loopback; {url!r} is not a loopback address")


def tcp_host(url: str) -> str:
    """The host of a tcp://HOST:PORT address (brackets of IPv6 removed); ValueError otherwise."""
    if not url.startswith("tcp://") or ":" not in url[6:]:
        raise ValueError(f"expected an address tcp://HOST:PORT, got {url!r}")
    return url[6:].rsplit(":", 1)[0].strip("[]")


def _existing(path: Path | None, name: str, *, directory: bool) -> Path:
    if path is None:
        raise ValueError(f"security mode curve needs {name}")
    if not (path.is_dir() if directory else path.is_file()):
        raise ValueError(f"{name} {str(path)!r} is not an existing "
                         f"{'directory' if directory else 'file'}")
    return path


def _load_key_pair(path: Path | None) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(_existing(path, "curve_key_pair", directory=False))
    if secret is None:
        raise ValueError(f"{str(path)!r} holds no secret key: pass the .key_secret file")
    return public, secret


def _read_secret(path: Path | None) -> str:
    if path is None:
        raise ValueError("security mode secret needs secret_file")
    try:
        secret = path.read_text(encoding="utf-8").strip()  # zmq.auth compares decoded strings
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read secret_file {str(path)!r} as UTF-8 text: {exc}") from None
    if not 0 < len(secret.encode()) <= _MAX_PLAIN_BYTES:
        raise ValueError(f"secret_file {str(path)!r} must hold 1..{_MAX_PLAIN_BYTES} bytes, "
                         f"holds {len(secret.encode())}")
    return secret
