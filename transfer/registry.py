"""The tiers below the host pool, registered in one place: a new tier is its folder plus one
`register_tier` call. The connector's options, its counters and the order in which the tiers are
asked all come from here; the offload core only sees the planners and workers made from it."""

from __future__ import annotations

from transfer.tier import TierSpec

_TIERS: dict[str, TierSpec] = {}


def register_tier(spec: TierSpec) -> None:
    """Add a tier; ValueError when its name, an option key or a counter is taken, or its option
    keys do not start with its name (they share the connector's one namespace of keys)."""
    if not spec.name.isidentifier() or spec.name in _TIERS:
        raise ValueError(f"tier name {spec.name!r} is not an identifier or is taken")
    if spec.enabled_by not in spec.options:
        raise ValueError(f"tier {spec.name!r}: enabled_by {spec.enabled_by!r} is not one of its "
                         f"options {sorted(spec.options)}")
    taken = {key for other in _TIERS.values() for key in other.options}
    for key in spec.options:
        if not key.startswith(f"{spec.name}_") or key in taken:
            raise ValueError(f"tier {spec.name!r}: option {key!r} must start with "
                             f"{spec.name + '_'!r} and be unique")
    _TIERS[spec.name] = spec


def unregister_tier(name: str) -> None:
    """Drop a tier (tests that register one of their own)."""
    _TIERS.pop(name, None)


def registered_tiers() -> list[TierSpec]:
    """Every registered tier, in the order they are asked (after the pool)."""
    _register_builtin()
    return sorted(_TIERS.values(), key=lambda spec: (spec.order, spec.name))


def tier_spec(name: str) -> TierSpec:
    _register_builtin()
    if name not in _TIERS:
        raise ValueError(f"no tier {name!r}; registered: {sorted(_TIERS)}")
    return _TIERS[name]


_builtin_done = False


def _register_builtin() -> None:
    """The tiers that ship with the library (imported here, on first use, so that importing the
    contract costs nothing)."""
    global _builtin_done
    if _builtin_done:
        return
    _builtin_done = True
    from transfer.disk.tier import DISK_TIER
    from transfer.remote.tier import REMOTE_TIER

    for spec in (DISK_TIER, REMOTE_TIER):
        register_tier(spec)
