"""Which blocks became loadable from which source and which stopped being loadable, for an
engine's event stream (vLLM's KV events, published by the adapter); tier-neutral.

A source is the pool (`POOL`) or a tier below it, by name. The scheduler core tells its
`BlockLog` (only when events are on: without one it does no event work at all):
- `stored`: blocks loadable from a source now: a store that completed on every worker, a fetch
  kept in the pool, a tier write every worker finished (its bad keys left out);
- `removed`: blocks no longer loadable: evicted (the pool's victims, a tier's own evictions
  drained after each write it plans), dropped after a failed load or a bad checksum, a tier's
  bad fetch;
- `cleared`: every block of a source (a reset, a pool lost with its daemon).

A source shared with other engines (a shared pool) is `fed` instead: what the core sees of it is
ignored, and `feed` applies the source's own ordered list of commits and removals (another
engine's included), read once a step.

The log announces a block once per source (a second store of a block it holds is no change) and
removes only what it announced, so a replay of its changes is exactly what each source can load.
What describes a block (tokens, parent, LoRA, ...) is the adapter's: the core calls `describe`
with the keys it plans to store or load while their request is alive, and a stored change
carries each key's description, taken then. Removals need none (a key holds its block hash).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (request id, keys) -> one description per key, or None for a key it cannot describe
Describe = Callable[[str, Sequence[bytes]], Sequence[Any]]


@dataclass(frozen=True)
class BlockChange:
    """`keys` became loadable from `source` (`stored`, with one description each in `about`)
    or stopped being loadable (`about` empty)."""

    source: str
    stored: bool
    keys: tuple[bytes, ...]
    about: tuple[Any, ...] = ()


class BlockLog:
    """The changes since the last `take`, and what each source holds as announced (see module
    doc). `describe`: the adapter's describer (None: stored changes carry None for each key)."""

    def __init__(self, sources: Iterable[str], describe: Describe | None = None,
                 fed: Iterable[str] = ()) -> None:
        self.held: dict[str, set[bytes]] = {source: set() for source in sources}
        self.fed = frozenset(fed) & set(self.held)
        self._settling: list[bytes] = []  # keys of ended jobs: descriptions to drop at take
        self._describe = describe
        self._about: dict[bytes, Any] = {}  # key -> its description, while held or planned
        self._writes: dict[int, tuple[str, tuple[bytes, ...]]] = {}  # tier write -> its keys
        self._writing: Counter[bytes] = Counter()  # key -> tier writes of it in flight
        self._changes: list[BlockChange] = []

    # ---- what the core reports -------------------------------------------------------------

    def planned(self, req_id: str, keys: Sequence[bytes]) -> None:
        """`keys` of live request `req_id` are about to be stored or loaded: describe the ones
        not described yet, while the request is there to describe them."""
        new = [key for key in keys if key not in self._about]
        if new and self._describe is not None:
            for key, about in zip(new, self._describe(req_id, new), strict=True):
                if about is not None:
                    self._about[key] = about

    def stored(self, source: str, keys: Iterable[bytes]) -> None:
        if source not in self.fed:
            self._stored(source, keys)

    def _stored(self, source: str, keys: Iterable[bytes]) -> None:
        held = self.held.get(source)
        if held is None:  # a source this engine does not publish
            return
        new = tuple(key for key in dict.fromkeys(keys) if key not in held)
        if new:
            held.update(new)
            self._changes.append(BlockChange(source, True, new,
                                             tuple(map(self._about.get, new))))

    def removed(self, source: str, keys: Iterable[bytes]) -> None:
        if source not in self.fed:
            self._removed(source, keys)

    def _removed(self, source: str, keys: Iterable[bytes]) -> None:
        held = self.held.get(source)
        if held is None:
            return
        gone = tuple(key for key in dict.fromkeys(keys) if key in held)
        if gone:
            held.difference_update(gone)
            self._changes.append(BlockChange(source, False, gone))

    def cleared(self, source: str) -> None:
        """Every block of `source` is gone, and its writes in flight will add none."""
        if source not in self.held:
            return
        for op_id in [op for op, (tier, _) in self._writes.items() if tier == source]:
            self.write_done(op_id, self._writes[op_id][1])  # as if every key failed
        if source not in self.fed:
            self._removed(source, list(self.held[source]))

    def feed(self, source: str, whole: bool, changes: Sequence[tuple[bool, bytes]]) -> None:
        """A fed source's own changes, in its order: (stored, key) each; `whole`: they are
        every block it holds now (stored ones), replacing what was known."""
        if source not in self.fed:
            return
        if whole:
            now = dict.fromkeys(key for stored, key in changes if stored)
            self._removed(source, [key for key in self.held[source] if key not in now])
            self._stored(source, now)
            return
        run: list[bytes] = []
        kind = True
        for stored, key in changes:  # runs of one kind, in order
            if run and stored != kind:
                (self._stored if kind else self._removed)(source, run)
                run = []
            kind = stored
            run.append(key)
        if run:
            (self._stored if kind else self._removed)(source, run)

    def write_planned(self, op_id: int, tier: str, keys: Sequence[bytes]) -> None:
        """A tier write of `keys` is in flight: they are loadable there once it completes."""
        if tier not in self.held:
            return
        self._writes[op_id] = (tier, tuple(keys))
        self._writing.update(keys)

    def write_done(self, op_id: int, bad: Sequence[bytes]) -> None:
        """The write ended on every worker: its keys but `bad` ones are loadable from its tier."""
        tier, keys = self._writes.pop(op_id, ("", ()))
        self._writing.subtract(keys)
        for key in keys:
            if self._writing[key] <= 0:
                del self._writing[key]
        if keys:
            failed = set(bad)
            self.stored(tier, [key for key in keys if key not in failed])

    def settled(self, keys: Iterable[bytes]) -> None:
        """A job over `keys` ended without making them loadable (a failed or outdated store,
        a failed load): at the next `take` (after a fed source's changes), forget the
        description of those no source holds then."""
        self._settling.extend(keys)

    # ---- what the adapter reads ------------------------------------------------------------

    def take(self) -> list[BlockChange]:
        """The changes since the last call, in order."""
        changes, self._changes = self._changes, []
        for change in changes:
            if not change.stored:
                self._settling.extend(change.keys)
        settling, self._settling = self._settling, []
        for key in settling:
            if key in self._about and not self.holds(key) and key not in self._writing:
                del self._about[key]
        return changes

    def holds(self, key: bytes) -> bool:
        return any(key in held for held in self.held.values())

    @property
    def described(self) -> int:
        """Descriptions kept (blocks held somewhere or in flight)."""
        return len(self._about)
