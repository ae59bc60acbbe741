"""The contract every tier keeps (transfer/tier.py), run on each registered tier over a real
backend: a slab file, a `kvconnector store serve` process, a local Redis Cluster, and the
memory tier these tests register (tests/tiers/memory_tier.py).

Each tier is driven only through its TierSpec (its settings from option values, its planner and
worker made by it, the worker bound to (num_slots, block_bytes) uint8 host rows), never through
its own classes. Cases: stored blocks come back bit-exact into poisoned slots; a block corrupted
in the backend is refused; a missing block is a clean miss; a bounded tier reports its evictions;
a restart finds the blocks or not, as the tier promises. A new tier gets these tests by adding
its backend to BACKENDS (test_every_registered_tier_has_a_backend fails until it does).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from process_memory import flip_in_process

from transfer.checksums import block_checksum
from transfer.disk.slab import ALIGN, DiskError, open_direct, slab_path, slot_bytes
from transfer.keys import Namespace
from transfer.registry import registered_tiers, tier_spec
from transfer.tier import OpResult, PlannerContext, TierOp, TierSpec, WorkerContext

BLOCK_BYTES = 8192  # whole pages: the disk tier reads and writes rows with O_DIRECT
NUM_SLOTS = 16
ROOMY = 64  # blocks a bounded tier holds where a case does not test its capacity
CAPACITY = 4  # blocks of a bounded tier in the eviction case
POISON = 0xAB
WAIT_S = 20.0  # bound of every wait for a lookup or an op (a loaded 2-core machine)
NS = Namespace(model="tier-contract", dtype="bfloat16", block_size=16, block_layout="test")


# ---- the backends -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """One tier over one real backend, and what the tier promises there.

    `survives_restart`: a new planner and worker from the same settings find the blocks;
    `drops_bad`: a block whose fetch failed leaves the tier's index (else it stays a hit and
    fails again); `bad_gone_at_restart`: such a block is gone from the backend too, so a restart
    (or another engine) does not offer it (else it is offered once more after a restart, and
    dropped again when that fetch fails); `capacity_key`: the option that bounds the tier in
    blocks (None: `unbounded` says why the eviction case does not apply); `corrupt_skip`: why a
    block cannot be corrupted from outside the tier (None: it can)."""

    id: str
    tier: str
    survives_restart: bool
    drops_bad: bool
    bad_gone_at_restart: bool = False
    capacity_key: str | None = None
    unbounded: str = ""
    corrupt_skip: str | None = None
    redis: bool = False


_REMOTE_UNBOUNDED = ("the remote tier reports no evictions (its TierSpec declares no such "
                     "counter): the server evicts on its own and the tier sees a later miss; "
                     "and the test's server holds far more than the test writes")

BACKENDS = [
    Backend("disk-slab", "disk", survives_restart=True, drops_bad=True,
            capacity_key="disk_bytes"),
    Backend("remote-store", "remote", survives_restart=True, drops_bad=True,
            bad_gone_at_restart=True, unbounded=_REMOTE_UNBOUNDED),
    Backend("remote-redis", "remote", survives_restart=True, drops_bad=True,
            bad_gone_at_restart=True, unbounded=_REMOTE_UNBOUNDED, redis=True),
    Backend("memory", "memory", survives_restart=False, drops_bad=True,
            capacity_key="memory_blocks"),
]


def _params(skip: Callable[[Backend], str | None] = lambda backend: None) -> list[Any]:
    """BACKENDS as parameters; `skip`: why a case does not apply to one (skipped at collection,
    so no server starts for it)."""
    params = []
    for b in BACKENDS:
        marks = [pytest.mark.redis] if b.redis else []
        if (reason := skip(b)) is not None:
            marks.append(pytest.mark.skip(reason=reason))
        params.append(pytest.param(b, id=b.id, marks=marks))
    return params


@dataclass
class Served:
    """A backend up for one test: the tier's option values for a capacity in blocks, and how to
    corrupt one stored block in it (`corrupt(rig, key, write_op)`)."""

    values: Callable[[int], dict[str, Any]]
    corrupt: Callable[[TierRig, bytes, TierOp], None] | None


def _disk(tmp_path: Path) -> Served:
    directory = tmp_path / "disk"
    directory.mkdir()
    try:
        os.close(open_direct(directory / ".probe", os.O_RDWR | os.O_CREAT))
    except DiskError as exc:
        pytest.skip(f"no O_DIRECT under {directory}: {exc}")

    def corrupt(rig: TierRig, key: bytes, op: TierOp) -> None:
        # One byte in the middle of the block, in the slot its planner placed it in; the
        # footer (key, checksum) stays as written.
        place = op.places[op.keys.index(key)]
        offset = ALIGN + place * slot_bytes(BLOCK_BYTES) + BLOCK_BYTES // 2
        with open(slab_path(directory, NS.digest), "r+b") as slab:
            slab.seek(offset)
            byte = slab.read(1)[0]
            slab.seek(offset)
            slab.write(bytes([byte ^ 0x01]))
            slab.flush()
            os.fsync(slab.fileno())

    return Served(lambda blocks: {"disk_path": str(directory),
                                  "disk_bytes": blocks * slot_bytes(BLOCK_BYTES)}, corrupt)


def _store(request: pytest.FixtureRequest) -> Served:
    server = request.getfixturevalue("store_server")

    def corrupt(rig: TierRig, key: bytes, op: TierOp) -> None:
        # The store checks every put's checksum and keeps it, so only its memory can be
        # changed from outside: the block's bytes in the server process.
        block = rig.rows[op.slots[op.keys.index(key)]].numpy().tobytes()
        try:
            changed = flip_in_process(server.pid, block)
        except PermissionError as exc:
            pytest.skip(f"cannot write the store process's memory here: {exc}")
        assert changed >= 1, "the block's bytes are not in the store process"

    return Served(lambda blocks: {"remote_url": server.url, "remote_lookup_deadline_s": 5.0,
                                  "remote_timeout_s": 5.0}, corrupt)


def _redis(request: pytest.FixtureRequest) -> Served:
    from transfer.remote.redis.values import HEADER_BYTES, redis_key

    cluster = request.getfixturevalue("redis_cluster")

    def corrupt(rig: TierRig, key: bytes, op: TierOp) -> None:
        # The value's header (and its checksum) stays; one byte of the block changes.
        admin = cluster.admin()
        try:
            where = HEADER_BYTES + BLOCK_BYTES // 2
            byte = admin.getrange(redis_key(key), where, where)
            assert len(byte) == 1, f"no value under {redis_key(key)!r}"
            admin.setrange(redis_key(key), where, bytes([byte[0] ^ 0x01]))
        finally:
            admin.close()

    return Served(lambda blocks: {"remote_url": cluster.url,
                                  "remote_redis_password_file": str(cluster.password_file),
                                  "remote_lookup_deadline_s": 5.0, "remote_timeout_s": 5.0},
                  corrupt)


def _memory(request: pytest.FixtureRequest) -> Served:
    request.getfixturevalue("memory_tier")  # registered for this test

    def corrupt(rig: TierRig, key: bytes, op: TierOp) -> None:
        rig.planner.blocks.corrupt(key)  # the memory tier's hook: its dict is the backend

    return Served(lambda blocks: {"memory_blocks": blocks}, corrupt)


_SERVE: dict[str, Callable[[pytest.FixtureRequest, Path], Served]] = {
    "disk-slab": lambda request, tmp_path: _disk(tmp_path),
    "remote-store": lambda request, tmp_path: _store(request),
    "remote-redis": lambda request, tmp_path: _redis(request),
    "memory": lambda request, tmp_path: _memory(request),
}


# ---- one engine's parts of a tier ----------------------------------------------------------------

def settings_of(spec: TierSpec, given: dict[str, Any]) -> Any:
    """The tier's settings from `given` option values, its defaults filled in, each value
    checked by its option first (as the connector does)."""
    unknown = set(given) - set(spec.options)
    assert not unknown, f"{sorted(unknown)} are not options of tier {spec.name!r}"
    values = {key: option.default for key, option in spec.options.items()} | given
    for key, value in given.items():
        check = spec.options[key].check
        if check is not None:
            check(key, value)
    return spec.settings(values)


class TierRig:
    """A tier's planner and worker made through its TierSpec, the worker bound to NUM_SLOTS host
    rows of BLOCK_BYTES (page-aligned: mmap)."""

    def __init__(self, spec: TierSpec, settings: Any) -> None:
        self.spec = spec
        self.settings = settings
        self._memory = mmap.mmap(-1, NUM_SLOTS * BLOCK_BYTES)
        self.rows = torch.frombuffer(self._memory, dtype=torch.uint8).view(NUM_SLOTS,
                                                                            BLOCK_BYTES)
        self.planner = spec.make_planner(settings, PlannerContext(
            NS, num_workers=1, slot_bytes=BLOCK_BYTES, rank_namespaces=(NS,)))
        self.worker = spec.make_worker(settings, WorkerContext(
            rank=0, part_bytes=BLOCK_BYTES, slot_bytes=BLOCK_BYTES, own_namespace=NS,
            common_namespace=NS))
        self.worker.bind(self.rows, None)
        self._next_op = 0
        self._lookups = 0
        self.closed = False

    def op_id(self) -> int:
        self._next_op += 1
        return self._next_op

    def lookup(self, keys: Sequence[bytes]) -> int:
        """The planner's answer, asked again while it says "not yet" (bounded)."""
        self._lookups += 1
        req_id = f"lookup-{self._lookups}"
        deadline = time.monotonic() + WAIT_S
        try:
            while (found := self.planner.lookup(req_id, keys)) is None:
                assert time.monotonic() < deadline, f"no lookup answer within {WAIT_S} s"
                time.sleep(0.005)
        finally:
            self.planner.forget(req_id)
        return found

    def finish(self, op_id: int) -> OpResult:
        """The op's result from get_finished (bounded wait); no other op may finish."""
        deadline = time.monotonic() + WAIT_S
        while True:
            results = self.worker.get_finished()
            assert [r.op_id for r in results] in ([], [op_id]), results
            if results:
                assert results[0].tier == self.spec.name
                return results[0]
            assert time.monotonic() < deadline, f"op {op_id} did not finish within {WAIT_S} s"
            self.worker.wait([op_id])

    def write(self, keys: Sequence[bytes], slots: Sequence[int]) -> TierOp:
        """Write `slots` under `keys` as the core would (a stored block where the tier writes
        stored blocks, else an evicted one); every block must succeed."""
        op_id = self.op_id()
        op = self.planner.plan_write(op_id, keys, slots,
                                     evicted=not self.planner.writes_stored)
        assert op is not None and (op.tier, op.op_id, op.is_write) == (self.spec.name, op_id,
                                                                        True)
        self.worker.submit(op)
        result = self.finish(op_id)
        assert result.ok == (True,) * len(op.keys), result
        self.planner.complete_write(op_id, [])
        return op

    def fetch(self, keys: Sequence[bytes], slots: Sequence[int], *,
              bad: Callable[[OpResult], list[bytes]] | None = None
              ) -> tuple[TierOp, OpResult] | None:
        """Plan, run and complete a fetch; None when the planner refuses it (a key it lacks).
        The keys whose block failed are completed as bad."""
        op_id = self.op_id()
        op = self.planner.plan_fetch(op_id, keys, slots)
        if op is None:
            return None
        assert (op.tier, op.op_id, op.is_write, op.keys, op.slots) == (
            self.spec.name, op_id, False, tuple(keys), tuple(slots))
        self.worker.submit(op)
        result = self.finish(op_id)
        assert len(result.ok) == len(keys)
        failed = [key for key, ok in zip(keys, result.ok, strict=True) if not ok]
        self.planner.complete_fetch(op_id, keys, failed)
        return op, result

    def counters(self) -> dict[str, float]:
        """The planner's and the worker's counters since the last call; every name must be
        one the TierSpec declares."""
        counts = self.planner.take_counters()
        for name, value in self.worker.take_counters().items():
            counts[name] = counts.get(name, 0) + value
        undeclared = set(counts) - set(self.spec.counters)
        assert not undeclared, f"counters {sorted(undeclared)} are not in the TierSpec's"
        return counts

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker.close()
            self.planner.close()


@pytest.fixture
def served(backend: Backend, request: pytest.FixtureRequest, tmp_path: Path) -> Served:
    return _SERVE[backend.id](request, tmp_path)


@pytest.fixture
def make_rig(backend: Backend, served: Served) -> Iterator[Callable[..., TierRig]]:
    """make(blocks=ROOMY, settings=None) -> a TierRig of the backend's tier, closed after the
    test; `settings` reuses an earlier rig's (a restart)."""
    rigs: list[TierRig] = []

    def make(blocks: int = ROOMY, settings: Any = None) -> TierRig:
        spec = tier_spec(backend.tier)
        if settings is None:
            settings = settings_of(spec, served.values(blocks))
        rig = TierRig(spec, settings)
        rigs.append(rig)
        return rig

    yield make
    for rig in reversed(rigs):
        rig.close()


# ---- helpers -------------------------------------------------------------------------------------

def keys_for(n: int) -> list[bytes]:
    """`n` keys no other test uses (the store and the cluster live for the whole module)."""
    token = secrets.token_hex(6)
    return NS.keys([f"{token}-{i}".encode() for i in range(n)])


def fill(rig: TierRig, slots: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Random bytes in `slots`; returns copies of them."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for slot in slots:
        rig.rows[slot].copy_(torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8,
                                           generator=generator))
        out.append(rig.rows[slot].clone())
    return out


def poison(rig: TierRig, slots: Sequence[int]) -> None:
    for slot in slots:
        rig.rows[slot].fill_(POISON)


def sums_of(blocks: Sequence[torch.Tensor], keys: Sequence[bytes]) -> tuple[int, ...]:
    return tuple(block_checksum(b.numpy(), k) for b, k in zip(blocks, keys, strict=True))


# ---- the cases -----------------------------------------------------------------------------------

def test_every_registered_tier_has_a_backend(memory_tier: TierSpec) -> None:
    registered = {spec.name for spec in registered_tiers()}
    assert {"disk", "remote", "memory"} <= registered
    assert registered <= {b.tier for b in BACKENDS}, \
        f"tiers {sorted(registered - {b.tier for b in BACKENDS})} have no backend in BACKENDS"
    for b in BACKENDS:  # a bounded tier reports its evictions under the declared name
        spec = tier_spec(b.tier)
        assert (b.capacity_key is not None) == ("evictions" in spec.counters), b.id
        assert b.capacity_key is None or b.capacity_key in spec.options
        assert b.capacity_key is not None or b.unbounded


@pytest.mark.parametrize("backend", _params())
def test_store_then_load_bit_exact(backend: Backend, make_rig: Callable[..., TierRig]) -> None:
    rig = make_rig()
    keys = keys_for(4)
    written = fill(rig, [0, 1, 2, 3], seed=1)
    assert rig.lookup(keys) == 0
    op = rig.write(keys, [0, 1, 2, 3])
    assert op.keys == tuple(keys) and op.slots == (0, 1, 2, 3)
    assert rig.lookup(keys) == 4
    assert rig.lookup(keys + keys_for(1)) == 4  # leading keys only
    assert rig.lookup(keys_for(1) + keys) == 0
    poison(rig, range(4, NUM_SLOTS))
    fetched = rig.fetch(keys, [8, 9, 10, 11])
    assert fetched is not None
    _, result = fetched
    assert result.ok == (True,) * 4
    for i, slot in enumerate([8, 9, 10, 11]):
        assert torch.equal(rig.rows[slot], written[i]), f"block {i} in slot {slot} differs"
    for slot in [4, 5, 6, 7, *range(12, NUM_SLOTS)]:  # nothing else was written
        assert bool((rig.rows[slot] == POISON).all()), f"slot {slot} changed"
    assert result.sums in ((), sums_of(written, keys))  # verified checksums, where reported
    counts = rig.counters()
    for name, expected in (("read_bytes", 4 * BLOCK_BYTES), ("write_bytes", 4 * BLOCK_BYTES),
                           ("failed_reads", 0), ("failed_writes", 0), ("evictions", 0)):
        if name in rig.spec.counters:
            assert counts.get(name) == expected, (name, counts)
    assert rig.lookup(keys) == 4  # a fetch takes nothing away


@pytest.mark.parametrize("backend", _params(lambda backend: backend.corrupt_skip))
def test_a_corrupt_block_is_refused(backend: Backend, served: Served,
                                    make_rig: Callable[..., TierRig]) -> None:
    assert served.corrupt is not None
    rig = make_rig()
    keys = keys_for(3)
    written = fill(rig, [0, 1, 2], seed=2)
    op = rig.write(keys, [0, 1, 2])
    assert rig.lookup(keys) == 3
    served.corrupt(rig, keys[1], op)
    poison(rig, [5, 6, 7])
    fetched = rig.fetch(keys, [5, 6, 7])
    assert fetched is not None
    _, result = fetched
    assert result.ok == (True, False, True)  # the bad block fails alone
    assert torch.equal(rig.rows[5], written[0]) and torch.equal(rig.rows[7], written[2])
    assert not torch.equal(rig.rows[6], written[1])  # never served as good
    if result.sums:
        assert (result.sums[0], result.sums[2]) == (sums_of(written, keys)[0],
                                                    sums_of(written, keys)[2])
    counts = rig.counters()
    if "failed_reads" in rig.spec.counters:
        assert counts["failed_reads"] == 1
    # complete_fetch named it bad: a tier that drops bad blocks no longer offers it
    assert rig.lookup(keys[1:2]) == (0 if backend.drops_bad else 1)
    assert rig.lookup(keys[2:]) == 1
    poison(rig, [6])
    again = rig.fetch(keys[1:2], [6])
    if backend.drops_bad:
        assert again is None  # the planner refuses a block it dropped
    else:  # still there, still refused
        assert again is not None and again[1].ok == (False,)
    assert not torch.equal(rig.rows[6], written[1])
    if backend.survives_restart:
        # After a restart: not offered where the backend lost it (a remote store is every
        # engine's); else offered once more, refused again. Written anew, it loads bit-exact.
        rig.close()
        again = make_rig(settings=rig.settings)
        if backend.bad_gone_at_restart:
            deadline = time.monotonic() + WAIT_S
            while (found := again.lookup(keys)) != 1:  # its removal is not awaited
                assert time.monotonic() < deadline, f"the damaged block is offered: {found}"
                time.sleep(0.01)
        else:
            assert again.lookup(keys) == 3
            poison(again, [4, 5, 6])
            fetched = again.fetch(keys, [4, 5, 6])
            assert fetched is not None and fetched[1].ok == (True, False, True)
            assert not torch.equal(again.rows[5], written[1]) and again.lookup(keys) == 1
        again.rows[1].copy_(written[1])
        again.write(keys[1:2], [1])
        assert again.lookup(keys) == 3
        poison(again, [6])
        fetched = again.fetch(keys[1:2], [6])
        assert fetched is not None and fetched[1].ok == (True,)
        assert torch.equal(again.rows[6], written[1])


@pytest.mark.parametrize("backend", _params())
def test_a_missing_block_is_a_clean_miss(backend: Backend,
                                         make_rig: Callable[..., TierRig]) -> None:
    rig = make_rig()
    missing, stored = keys_for(2), keys_for(1)
    assert rig.lookup(missing) == 0
    if rig.planner.answers_per_key:
        assert rig.planner.present(missing) == [False, False]
    fill(rig, [0], seed=3)
    rig.write(stored, [0])
    poison(rig, [4, 5])
    fetched = rig.fetch(missing, [4, 5])
    if fetched is not None:  # a tier that finds blocks by key asks its backend
        assert fetched[1].ok == (False, False)
    else:
        # The planner refused; its worker must miss too when handed such a key anyway: a
        # planned fetch of a stored block, its key swapped for a missing one.
        op_id = rig.op_id()
        op = rig.planner.plan_fetch(op_id, stored, [4])
        assert op is not None
        rig.worker.submit(dataclasses.replace(op, keys=tuple(missing[:1])))
        assert rig.finish(op_id).ok == (False,)
        rig.planner.complete_fetch(op_id, stored, [])
    assert rig.lookup(stored) == 1  # a miss takes nothing else away
    if rig.planner.answers_per_key:
        assert rig.planner.present(missing + stored) == [False, False, True]


@pytest.mark.parametrize("backend", _params(
    lambda backend: None if backend.capacity_key else f"not applicable: {backend.unbounded}"))
def test_an_eviction_is_reported(backend: Backend, make_rig: Callable[..., TierRig]) -> None:
    rig = make_rig(CAPACITY)
    keys = keys_for(CAPACITY + 2)
    written = fill(rig, range(CAPACITY + 2), seed=4)
    # One write a block, oldest first (within one write a tier may order its blocks as it
    # likes: the disk evicts the tail of a prefix first).
    for i in range(CAPACITY):
        rig.write(keys[i:i + 1], [i])
    assert rig.counters().get("evictions") == 0
    for i in range(CAPACITY, CAPACITY + 2):
        assert rig.write(keys[i:i + 1], [i]).keys == (keys[i],)
    assert rig.counters()["evictions"] == 2
    assert [rig.lookup([key]) for key in keys] == [0, 0] + [1] * CAPACITY  # the oldest went
    poison(rig, [*range(8, 8 + CAPACITY), 15])
    fetched = rig.fetch(keys[2:], range(8, 8 + CAPACITY))
    assert fetched is not None and fetched[1].ok == (True,) * CAPACITY
    for i in range(CAPACITY):
        assert torch.equal(rig.rows[8 + i], written[2 + i])
    evicted = rig.fetch(keys[:1], [15])
    assert evicted is None or evicted[1].ok == (False,)
    assert bool((rig.rows[15] == POISON).all())


@pytest.mark.parametrize("backend", _params())
def test_restart_behaves_as_promised(backend: Backend,
                                     make_rig: Callable[..., TierRig]) -> None:
    rig = make_rig()
    keys = keys_for(3)
    written = fill(rig, [0, 1, 2], seed=5)
    rig.write(keys, [0, 1, 2])
    assert rig.lookup(keys) == 3
    rig.close()  # the engine stops: its worker and planner closed
    again = make_rig(settings=rig.settings)  # and starts again, same settings, same backend
    found = again.lookup(keys)
    assert found == (3 if backend.survives_restart else 0)
    poison(again, [4, 5, 6])
    fetched = again.fetch(keys, [4, 5, 6])
    if backend.survives_restart:
        assert fetched is not None and fetched[1].ok == (True,) * 3
        for i in range(3):
            assert torch.equal(again.rows[4 + i], written[i])
    else:
        assert fetched is None or fetched[1].ok == (False,) * 3
        assert all(bool((again.rows[s] == POISON).all()) for s in [4, 5, 6])
