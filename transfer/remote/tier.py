"""The remote tier as the connector registers it (transfer/registry.py): a `kvconnector store
serve` store (tcp://) or a Redis Cluster (redis://, rediss://) below the pool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transfer.options import (
    Option,
    check_choice,
    check_flag,
    check_readable_file,
    check_seconds,
    check_text,
)
from transfer.remote.planner import RemotePlanner
from transfer.remote.settings import (
    SECURITY_CHOICES,
    RemoteSettings,
    is_redis_url,
    make_redis_auth,
    make_security,
)
from transfer.remote.worker import RemoteWorker
from transfer.tier import PlannerContext, TierSpec, WorkerContext

_REDIS_KEYS = ("remote_redis_user", "remote_redis_password_file", "remote_redis_ca_file")
_ZMQ_KEYS = ("remote_secret_file", "remote_curve_key_pair", "remote_curve_server_key")


def remote_settings(values: Mapping[str, Any]) -> RemoteSettings:
    """remote_url: a store's URL (tcp://) or a Redis Cluster's seeds
    (redis://[user@]host:port[,host:port...], rediss:// for TLS). tcp://: remote_security
    "none" (loopback only), "secret" (remote_secret_file) or "curve" (remote_curve_key_pair,
    remote_curve_server_key). redis(s)://: remote_redis_user (ACL user),
    remote_redis_password_file (else $KVCONNECTOR_REDIS_PASSWORD; none: loopback only),
    remote_redis_ca_file (rediss://). remote_lookup_deadline_s: how long a lookup may keep a
    request waiting; remote_timeout_s: bound of each get and put; remote_only: the host pool
    only stages blocks on their way to and from the store."""
    url = values["remote_url"]
    if is_redis_url(url):
        given = [k for k in _ZMQ_KEYS if values[k] is not None]
        if given or values["remote_security"] != "none":
            raise ValueError(f"{given or ['remote_security']} are for tcp:// stores; "
                             f"{url!r} is a Redis URL (use remote_redis_*)")
        credentials = make_redis_auth(url, values["remote_redis_user"],
                                      values["remote_redis_password_file"],
                                      values["remote_redis_ca_file"])
    else:
        given = [k for k in _REDIS_KEYS if values[k] is not None]
        if given:
            raise ValueError(f"{given} are for redis:// URLs, not {url!r}")
        for key in _ZMQ_KEYS:  # read when the first client connects: named at start-up
            check_readable_file(key, values[key])
        credentials = make_security(url, values["remote_security"], values["remote_secret_file"],
                                    values["remote_curve_key_pair"],
                                    values["remote_curve_server_key"])
    return RemoteSettings(url, credentials, float(values["remote_lookup_deadline_s"]),
                          float(values["remote_timeout_s"]), values["remote_only"])


def remote_planner(settings: RemoteSettings, context: PlannerContext) -> RemotePlanner:
    return RemotePlanner(settings, context.namespace.digest)


def remote_worker(settings: RemoteSettings, context: WorkerContext) -> RemoteWorker:
    """Puts and gets under the keys of bytes every TP rank holds alike where they are (MLA):
    one copy in the store, put by one rank."""
    return RemoteWorker(settings, context.common_namespace.digest, context.writes_common)


REMOTE_TIER = TierSpec(
    name="remote",
    options={
        "remote_url": Option(None, check_text),
        "remote_security": Option("none", lambda key, value: check_choice(key, value,
                                                                          SECURITY_CHOICES)),
        **{key: Option(None, check_text) for key in _ZMQ_KEYS + _REDIS_KEYS},
        "remote_lookup_deadline_s": Option(0.2, check_seconds),
        "remote_timeout_s": Option(5.0, check_seconds),
        "remote_only": Option(False, check_flag),
    },
    enabled_by="remote_url",
    settings=remote_settings,
    make_planner=remote_planner,
    make_worker=remote_worker,
    counters=("hit_tokens", "lookup_failures"),
    # vLLM 0.32 has no remote-store member: EXTERNAL_UNSPECIFIED is its "remote store".
    hit_source="EXTERNAL_UNSPECIFIED",
    order=20,
    stages_pool="remote_only",
)
