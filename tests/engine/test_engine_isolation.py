"""Tenants in vLLM's real CPU engine (TP 1, in process): requests with the same tokens and
different `cache_salt` never share an offloaded block, in any tier.

One engine with every tier: a host pool of 4 slots, a disk below it (policy "evict": a block
goes to disk when the pool evicts it) and a remote store (every stored block is put there).
Tenant A's 200-token prompt (6 full blocks, 4 of them stored: the pool's room) is computed;
then tenant B sends the same tokens with another salt while A's blocks sit in the pool and the
store: B loads nothing and stores its own 4 blocks, which evict A's to disk; tenant C, the same
tokens again, finds A's blocks on disk, B's in the pool, both in the store, and loads nothing.
With the pool and the disk emptied, tenant D finds only the store's copies and loads nothing.
Each time, the same salt again loads the blocks (from the pool, the disk, the store): they were
there to be found.

The negative control runs the same scenario with the offload keys made from the tokens alone
(what a connector that drops the salt would key blocks by): then the other tenants load each
other's blocks, and the scenario reports it, so the test can fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import xxhash
from engine_support import (
    BLOCK_SIZE,
    block_bytes,
    counted,
    counters,
    forget_everything,
    running_llm,
    scheduler_connector,
    settle,
)
from request_support import generate_for
from tiny_llama import prompt_ids

from transfer.disk.slab import slot_bytes

if TYPE_CHECKING:
    from vllm import LLM

    from kvconnector.servers.store import StoreProcess

pytestmark = pytest.mark.engine

POOL_SLOTS = 4
STORED = POOL_SLOTS * BLOCK_SIZE  # tokens of a tenant's prompt that are stored: 128
REMOTE_DEADLINE_S = 30.0  # a busy 2-core machine: a late lookup would quietly answer "none"


@pytest.fixture(scope="module")
def llm(tiny_model: str, store: StoreProcess,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    disk: Path = tmp_path_factory.mktemp("disk")
    extra = {"cpu_bytes": POOL_SLOTS * block_bytes(), "disk_path": str(disk),
             "disk_bytes": 64 * slot_bytes(block_bytes()), "disk_write_policy": "evict",
             "remote_url": store.url, "remote_security": "none",
             "remote_lookup_deadline_s": REMOTE_DEADLINE_S, "remote_timeout_s": REMOTE_DEADLINE_S}
    with running_llm(tiny_model, extra) as engine:
        yield engine


def loaded(llm: LLM, prompt: list[int], salt: str) -> dict[str, float]:
    """Run `prompt` as tenant `salt` (after settle: stores done, vLLM's prefix cache empty);
    the tokens the connector loaded for it, by where they came from, and what it stored."""
    settle(llm)
    before = counters(llm)
    generate_for(llm, prompt, cache_salt=salt)
    gained = counted(llm, before)
    return {"hit": gained["kvconnector_hit_tokens"],
            "disk": gained["kvconnector_disk_hit_tokens"],
            "remote": gained["kvconnector_remote_hit_tokens"],
            "stored_blocks": gained["kvconnector_store_bytes"] // block_bytes()}


def shared_between_tenants(llm: LLM, prompt: list[int], tag: str) -> dict[str, float]:
    """The scenario of the module doc, for `prompt`: the tokens each other tenant loaded
    (B while A's blocks were in the pool, C while they were on disk, D while only the store
    held them) and stored, and where tenant A's own reloads found its blocks (each must find
    all of them: they were there to be found)."""
    forget_everything(llm)
    first = loaded(llm, prompt, f"{tag}-a")
    assert (first["hit"], first["stored_blocks"]) == (0, POOL_SLOTS), first
    b = loaded(llm, prompt, f"{tag}-b")  # A's blocks in the pool and the store
    c = loaded(llm, prompt, f"{tag}-c")  # A's on disk, B's in the pool, both stored
    a_again = loaded(llm, prompt, f"{tag}-a")
    forget_everything(llm)  # the pool and the disk: the store keeps every tenant's blocks
    d = loaded(llm, prompt, f"{tag}-d")
    a_last = loaded(llm, prompt, f"{tag}-a")
    forget_everything(llm)
    return {"b_loaded": b["hit"], "c_loaded": c["hit"], "d_loaded": d["hit"],
            "b_stored": b["stored_blocks"], "c_stored": c["stored_blocks"],
            "a_loaded_from_disk": a_again["disk"], "a_loaded": a_again["hit"],
            "a_loaded_from_store": a_last["remote"], "a_loaded_last": a_last["hit"]}


def test_same_tokens_with_different_salts_never_share_a_block_in_any_tier(llm: LLM) -> None:
    shared = shared_between_tenants(llm, prompt_ids(41, 200), "salt")
    # nothing loaded across tenants, and each stored its own blocks (none matched another's
    # key), while A's own blocks were found on disk, then in the store
    assert shared == {"b_loaded": 0, "c_loaded": 0, "d_loaded": 0, "b_stored": POOL_SLOTS,
                      "c_stored": POOL_SLOTS, "a_loaded_from_disk": STORED, "a_loaded": STORED,
                      "a_loaded_from_store": STORED, "a_loaded_last": STORED}, shared


def _unsalted_keys(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Key every prompt block by a chained hash of its tokens alone, as a connector that drops
    the salt would (the negative control)."""
    connector = scheduler_connector(llm)
    core = connector._core()
    unsalted: dict[Any, bytes] = {}
    on_new_request, keys = connector.on_new_request, core._keys

    def learn(request: Any) -> None:
        chain = b""
        for i, block_hash in enumerate(request.block_hashes):
            tokens = request.prompt_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            chain = xxhash.xxh3_128_digest(chain + repr(tokens).encode())
            unsalted[block_hash] = chain
        on_new_request(request)

    monkeypatch.setattr(connector, "on_new_request", learn)
    monkeypatch.setattr(core, "_keys", lambda group, hashes:
                        keys(group, [unsalted.get(h, h) for h in hashes]))


def test_negative_control_keys_without_the_salt_are_shared_and_caught(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    _unsalted_keys(llm, monkeypatch)
    shared = shared_between_tenants(llm, prompt_ids(42, 200), "nosalt")
    # B loaded A's 4 pooled blocks and stored only the 2 A could not place; C and D loaded
    # what A and B left in the tiers: the scenario reports tenants sharing blocks
    assert (shared["b_loaded"], shared["b_stored"]) == (STORED, 2), shared
    assert shared["c_loaded"] > 0 and shared["d_loaded"] > 0, shared
