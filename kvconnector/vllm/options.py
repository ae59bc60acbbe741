"""`kv_connector_extra_config` of the vLLM connector, parsed and checked (no vLLM imports).

Its keys are the connector's own (below) and those of every registered tier
(transfer/registry.py), each tier's starting with its name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS
from kvconnector.offload.admission import DEFAULT_MAX_TRACKER_SIZE, AdmissionRules
from kvconnector.offload.prefetch import PrefetchRules
from transfer.copy.factory import BACKENDS
from transfer.engine import DEFAULT_MAX_STORE_BYTES
from transfer.options import check_bytes, check_choice, check_seconds, did_you_mean, show
from transfer.registry import registered_tiers
from transfer.shared.protocol import check_name
from transfer.tier import TierSpec

LAYOUT_CHOICES = ("auto", "engine", *BLOCK_MAJOR_ORDERS)
EVICTION_CHOICES = ("lru", "arc")
ERROR_PREFIX = "CrossLayerOffloadConnector kv_connector_extra_config: "


@dataclass(frozen=True)
class _ConnectorKeys:
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
    store_threshold: a block is stored once its prefix was offered this many times (0, 1: at
    once); max_tracker_size: prefixes whose offers are counted, at most. min_prefix_tokens: a
    request stores nothing until its computed full blocks hold this many tokens.
    max_store_blocks_in_flight: stores planned and not yet done, in blocks; past it a step's
    new stores are shed (counted, never waited for). See kvconnector/offload/admission.py.
    prefetch_blocks: blocks fetched ahead from the tiers below into the pool while requests
    wait (at most this many in flight; 0: off); prefetch_deadline_s: how long a request waits
    for them (kvconnector/offload/prefetch.py).
    Then every registered tier's keys (see its settings' docstring: disk_* in
    transfer/disk/tier.py, remote_* in transfer/remote/tier.py).
    """

    cpu_bytes: int | None = None
    pool: str | None = None
    eviction: str = "lru"
    layout: str = "auto"
    copy_backend: str = "auto"
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES
    store_threshold: int = 0
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    min_prefix_tokens: int = 0
    max_store_blocks_in_flight: int | None = None
    prefetch_blocks: int = 0
    prefetch_deadline_s: float = 1.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        """The options, every key and value checked; a bad one is a one-line ValueError naming
        the key, what it got and what it accepts (vLLM shows it as the engine's start-up error).
        """
        try:
            return cls._parse(extra)
        except ValueError as exc:  # also those of the tiers' settings and check_name
            raise ValueError(f"{ERROR_PREFIX}{exc}") from None

    @classmethod
    def _parse(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        if not isinstance(extra, Mapping):
            raise ValueError(f"must be a JSON object of keys, got {show(extra)}")
        defaults = {f.name: f.default for f in fields(ConnectorOptions)}
        unknown = [key for key in extra if key not in defaults]
        if unknown:
            raise ValueError(_unknown_keys(unknown, list(defaults)))
        if (extra.get("cpu_bytes") is None) == (extra.get("pool") is None):
            raise ValueError("needs exactly one of 'cpu_bytes' (host pool bytes per worker, "
                             "e.g. 68719476736 for 64 GiB) and 'pool' (a shared pool's name), "
                             f"got {show(extra.get('cpu_bytes'))} and {show(extra.get('pool'))}")
        checks = {**_CHECKS, **{key: option.check for spec in registered_tiers()
                                for key, option in spec.options.items()}}
        for key, value in extra.items():
            check = checks.get(key)
            if check is not None and (value is not None or defaults[key] is not None):
                check(key, value)  # null: an optional key unset
        options = ConnectorOptions(**extra)
        if options.cpu_bytes is not None and options.cpu_bytes > _host_memory_bytes():
            raise ValueError(f"cpu_bytes {options.cpu_bytes} ({_gib(options.cpu_bytes)}) is more "
                             f"than this host's memory ({_gib(_host_memory_bytes())}): each "
                             f"worker's pool is held in RAM")
        if options.pool is not None:
            check_name(options.pool)
        for spec in registered_tiers():
            if extra.get(spec.enabled_by) is None:
                given = sorted(k for k in spec.options if extra.get(k) is not None)
                if given:
                    raise ValueError(f"{given} given without {spec.enabled_by}")
        if "max_tracker_size" in extra and options.store_threshold < 2:
            raise ValueError(f"max_tracker_size given without store_threshold >= 2 (it counts "
                             f"offers for the threshold), got store_threshold "
                             f"{show(options.store_threshold)}")
        if options.prefetch_blocks and options.pool is not None:
            raise ValueError(f"prefetch_blocks {options.prefetch_blocks} with 'pool': a shared "
                             f"pool's blocks are committed with checksums taken on a load, so "
                             f"it is not prefetched into; set prefetch_blocks 0")
        settings = options.tier_settings()  # each enabled tier's keys checked together
        _check_across(options, settings)
        return options

    def admission(self) -> AdmissionRules:
        """The engine-wide admission rules."""
        return AdmissionRules(self.store_threshold, self.max_tracker_size,
                              self.min_prefix_tokens, self.max_store_blocks_in_flight)

    def prefetch(self) -> PrefetchRules:
        """The prefetch rules."""
        return PrefetchRules(self.prefetch_blocks, self.prefetch_deadline_s)

    def tier_settings(self) -> dict[str, Any]:
        """Each enabled tier's settings, by name, in the order the tiers are asked."""
        out = {}
        for spec in registered_tiers():
            values = {key: getattr(self, key) for key in spec.options}
            if values[spec.enabled_by] is not None:
                out[spec.name] = spec.settings(values)
        return out


def _check_across(options: _ConnectorKeys, settings: dict[str, Any]) -> None:
    """Rules between tiers: a pool that only stages one tier's blocks evicts none, so a shared
    pool cannot stage and every other tier must write each stored block."""
    specs = {spec.name: spec for spec in registered_tiers()}
    for name in settings:
        flag = specs[name].stages_pool
        if flag is None or not getattr(options, flag):
            continue
        if options.pool is not None:
            raise ValueError(f"{flag} drops the host tier; 'pool' is one: give one of them")
        for other, other_settings in settings.items():
            spec: TierSpec = specs[other]
            if other == name or getattr(other_settings, "writes_stored", True):
                continue
            key, value = spec.stored_writes or (spec.enabled_by, None)
            raise ValueError(f"{flag} with {spec.enabled_by} needs {key} {value!r} (every "
                             f"stored block written to it as it goes to {name}), got "
                             f"{getattr(options, key)!r}: with {flag} the pool evicts nothing")


ConnectorOptions = make_dataclass(
    "ConnectorOptions",
    [(key, Any, field(default=option.default)) for spec in registered_tiers()
     for key, option in spec.options.items()],
    bases=(_ConnectorKeys,), frozen=True)
ConnectorOptions.__doc__ = _ConnectorKeys.__doc__
ConnectorOptions.__module__ = __name__

_CHECKS = {
    "cpu_bytes": check_bytes,
    "max_store_bytes": check_bytes,
    "eviction": lambda key, value: check_choice(key, value, EVICTION_CHOICES),
    "layout": lambda key, value: check_choice(key, value, LAYOUT_CHOICES),
    "copy_backend": lambda key, value: check_choice(key, value, BACKENDS),
    "store_threshold": lambda key, value: _check_count(key, value, 0),
    "max_tracker_size": lambda key, value: _check_count(key, value, 1),
    "min_prefix_tokens": lambda key, value: _check_count(key, value, 0),
    "max_store_blocks_in_flight": lambda key, value: _check_count(key, value, 1),
    "prefetch_blocks": lambda key, value: _check_count(key, value, 0),
    "prefetch_deadline_s": check_seconds,
}


def _check_count(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {show(value)}")


def _unknown_keys(unknown: list[Any], known: list[str]) -> str:
    """One line: each unknown key with the known key it most resembles, then the known keys."""
    named = ", ".join(f"{show(key)}{did_you_mean(key, known)}" for key in unknown)
    return (f"unknown key{'s' if len(unknown) > 1 else ''} {named}; accepted keys: "
            f"{', '.join(known)}")


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"
