"""KV events in vLLM's real CPU engine: its own zmq publisher (`kv_events_config`), read over
loopback by this test as a router would (a SUB socket, `KVEventBatch` decoded with vLLM's
types), replayed into a view of (medium, block hash) per engine.

Engine A (in this process) has a pool shared with engine B (in a process of its own), a pool of
8 slots served by a real `kvconnector pool serve`, and a disk below it (policy "evict": the
blocks A's stores evict are written there). Workload: A computes P1 (6 blocks) then P3 (6 more:
4 of P1's go to disk); B computes P2 (its stores evict A's blocks from the shared pool); A
reloads P1 (from the pool and the disk); A resets its prefix cache and the connector's tiers
(the engines' namespace leaves the pool, A's disk empties). After each phase every engine's
view equals, block for block, what that engine can load from each tier (each block of the view
is in the tier's index, no loadable block is missing from the view), and the sequence numbers
have no gap. Negative control: A's events replayed without one BlockRemoved differ from what A
can load.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import pytest
from engine_support import (
    BLOCK_SIZE,
    block_bytes,
    generate,
    running_llm,
    scheduler_connector,
    settle,
)
from tiny_llama import prompt_ids

from kvconnector.servers.pool import PoolProcess

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine

POOL_SLOTS = 8
P1, P2, P3 = prompt_ids(41, 200), prompt_ids(42, 200), prompt_ids(43, 200)  # 6 blocks each
POKE = prompt_ids(44, 20)  # under a block: stores nothing, but steps the engine once
CHILD_TIMEOUT_S = 900.0  # an engine start on a busy 2-core machine
QUIET_S = 1.5  # no batch for this long: the publisher has sent what it had

Block = tuple[int | None, Any]  # (group index, external block hash)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def events_config(port: int) -> Any:
    """vLLM's zmq publisher, bound as in vLLM's default endpoint (`tcp://*:5557`) on a free
    port; the test's SUB socket connects to it over loopback."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                          endpoint=f"tcp://*:{port}")


class Subscriber:
    """A router's end of one engine's stream: every batch, decoded as vLLM's KVEventBatch."""

    def __init__(self) -> None:
        import zmq

        self.port = free_port()
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"tcp://127.0.0.1:{self.port}")  # before the engine binds: zmq
        # connects once it does
        self.events: list[Any] = []
        self.seqs: list[int] = []

    def drain(self) -> list[Any]:
        """Every batch published so far (until QUIET_S without one); the events, in order."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        quiet_until = time.monotonic() + QUIET_S
        while time.monotonic() < quiet_until:
            if self.socket.poll(timeout=100):
                _, seq, payload = self.socket.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events += decoder.decode(payload).events
                quiet_until = time.monotonic() + QUIET_S
        assert self.seqs == list(range(len(self.seqs))), "a batch was lost"
        return self.events

    def close(self) -> None:
        self.socket.close()


def replay(events: list[Any], strict: bool = True) -> dict[str, set[Block]]:
    """Medium -> blocks stored and not removed since; `strict`: the connector's media are exact
    (a block stored twice or removed unstored is an error). AllBlocksCleared: the GPU's."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    view: dict[str, set[Block]] = {"CPU": set(), "STORAGE": set()}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            view.pop("GPU", None)
            continue
        held = view.setdefault(event.medium, set())
        exact = strict and event.medium != "GPU"
        for block_hash in event.block_hashes:
            block = (event.group_idx, block_hash)
            if isinstance(event, BlockStored):
                assert not (exact and block in held), f"{event.medium}: stored twice"
                held.add(block)
            else:
                assert not (exact and block not in held), f"{event.medium}: removed unstored"
                held.discard(block)
    return {medium: view[medium] for medium in ("CPU", "STORAGE")}


def loadable(llm: LLM, hashes: list[bytes]) -> dict[str, set[Block]]:
    """What the engine can load now of the blocks `hashes` name: per medium, the blocks its
    pool's index (the daemon) and its disk's index hold readable."""
    from kvconnector.vllm.events import external_hash

    connector = scheduler_connector(llm)
    core, events = connector._scheduler, connector._events
    keys = list(dict.fromkeys(core._keys(core.groups[0], hashes)))

    def block(key: bytes) -> Block:
        group, block_hash = events._split(key)
        return group, external_hash(block_hash)

    out = {"CPU": {block(k) for k, ok in zip(keys, core.index.present(keys), strict=True)
                   if ok}, "STORAGE": set()}
    if "disk" in core._by_name:
        disk = core.tier("disk").index
        out["STORAGE"] = {block(k) for k in keys if disk.contains(k)}
    return out


def spy_hashes(llm: LLM) -> list[bytes]:
    """The block hashes of every request the engine finishes from now on."""
    connector = scheduler_connector(llm)
    seen: list[bytes] = []
    finish = connector.request_finished_all_groups

    def spy(request: Any, block_ids: Any) -> Any:
        seen.extend(bytes(h) for h in request.block_hashes)
        return finish(request, block_ids)

    connector.request_finished_all_groups = spy
    return seen


def engine_b(model_dir: str, pool: str, port: int, conn: Connection) -> None:
    """Engine B, in its own process: runs the parent's commands ("generate" a prompt, "poke",
    "truth" over block hashes, "stop") and answers each (its block hashes with "generate")."""
    try:
        with running_llm(model_dir, {"pool": pool}, kv_events_config=events_config(port)) as llm:
            hashes = spy_hashes(llm)
            conn.send("ready")
            while True:
                command, argument = conn.recv()
                if command == "generate":
                    generate(llm, argument, max_tokens=2)
                    settle(llm)
                    conn.send(list(hashes))
                elif command == "poke":
                    generate(llm, POKE, max_tokens=1)
                    conn.send("ok")
                elif command == "truth":
                    conn.send(loadable(llm, argument))
                else:
                    conn.send("stopped")
                    return
    except BaseException as exc:
        conn.send(f"engine B failed: {type(exc).__name__}: {exc}")
        raise


class Child:
    def __init__(self, model_dir: str, pool: str, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=engine_b, args=(model_dir, pool, port, theirs))
        self.process.start()
        assert self.answer() == "ready"

    def answer(self) -> Any:
        assert self.conn.poll(CHILD_TIMEOUT_S), "engine B did not answer"
        answer = self.conn.recv()
        assert not (isinstance(answer, str) and answer.startswith("engine B failed")), answer
        return answer

    def ask(self, command: str, argument: Any = None) -> Any:
        self.conn.send((command, argument))
        return self.answer()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.ask("stop")
            finally:
                self.process.join(60)
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join()


@pytest.fixture
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolProcess]:
    log = tmp_path_factory.mktemp("events-pool") / "pool.log"
    with PoolProcess(log, f"events-{uuid.uuid4().hex[:8]}",
                     capacity=str(POOL_SLOTS * block_bytes()),
                     slot_bytes=str(block_bytes())) as process:
        yield process


def test_each_engines_replayed_events_equal_what_it_can_load(
        tiny_model: str, pool: PoolProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    from transfer.disk.slab import slot_bytes

    disk = tmp_path_factory.mktemp("events-disk")
    routers = [Subscriber(), Subscriber()]
    child: Child | None = None
    extra = {"pool": pool.name, "disk_path": str(disk), "disk_bytes": 64 * slot_bytes(
        block_bytes()), "disk_write_policy": "evict"}
    try:
        with running_llm(tiny_model, extra, kv_events_config=events_config(routers[0].port)
                         ) as llm:
            hashes = spy_hashes(llm)
            child = Child(tiny_model, pool.name, routers[1].port)
            b_hashes: list[bytes] = []

            def views_are_true() -> dict[str, set[Block]]:
                """Both engines stepped once (each reads the pool's changes), then each view
                against what that engine can load; returns A's view."""
                generate(llm, POKE, max_tokens=1)
                child.ask("poke")
                everything = hashes + b_hashes
                view_a = replay(routers[0].drain())
                assert view_a == loadable(llm, everything)
                view_b = replay(routers[1].drain())
                assert view_b["CPU"] == child.ask("truth", everything)["CPU"]
                assert not view_b["STORAGE"]  # B has no disk
                return view_a

            generate(llm, P1, max_tokens=2)
            settle(llm)
            view = views_are_true()
            assert (len(view["CPU"]), len(view["STORAGE"])) == (6, 0)
            from vllm.distributed.kv_events import BlockStored

            stored = [e for e in routers[0].events if isinstance(e, BlockStored)]
            cpu = next(e for e in stored if e.medium == "CPU")  # described as vLLM's GPU's
            gpu = next(e for e in stored if e.medium == "GPU")
            assert cpu.block_hashes == gpu.block_hashes[:6]
            assert (cpu.token_ids, cpu.parent_block_hash, cpu.block_size) == (
                P1[:6 * BLOCK_SIZE], None, BLOCK_SIZE)
            assert (cpu.group_idx, cpu.kv_cache_spec_kind, cpu.ownership) == (
                0, "full_attention", f"shared_pool:{pool.name}")

            generate(llm, P3, max_tokens=2)  # 6 more in a pool of 8: 4 of P1's go to disk
            settle(llm)
            view = views_are_true()
            assert (len(view["CPU"]), len(view["STORAGE"])) == (8, 4)

            b_hashes = child.ask("generate", P2)  # B's stores evict A's blocks from the pool
            view = views_are_true()
            assert len(view["CPU"]) == 8 and len(view["STORAGE"]) == 4
            assert view["CPU"] == replay(routers[1].events)["CPU"]  # one pool: one view

            # Negative control: A's stream without one of its BlockRemoved claims a block A
            # cannot load.
            from vllm.distributed.kv_events import BlockRemoved

            events = routers[0].events
            lost = next(i for i, e in enumerate(events)
                        if isinstance(e, BlockRemoved) and e.medium == "CPU")
            short = replay(events[:lost] + events[lost + 1:], strict=False)
            assert short["CPU"] != loadable(llm, hashes + b_hashes)["CPU"]

            generate(llm, P1, max_tokens=2)  # reloaded: its disk blocks come back to the pool
            settle(llm)
            views_are_true()

            assert llm.reset_prefix_cache(reset_connector=True)
            view = views_are_true()
            assert view == {"CPU": set(), "STORAGE": set()}
    finally:
        if child is not None:
            child.stop()
        for router in routers:
            router.close()
