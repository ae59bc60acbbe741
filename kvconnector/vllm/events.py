"""The connector's KV events: the blocks each of its tiers can load, in vLLM's own stream.

With vLLM's `--kv-events-config` on, vLLM publishes a `KVEventBatch` every step with its GPU
cache's events and those the connector's `take_events` returns. `ConnectorEvents` turns the
scheduler core's block changes (kvconnector/offload/events.py: a block loadable from a source
once every worker stored it, no longer once evicted, dropped, failed or cleared) into
`BlockStored` / `BlockRemoved` events under the same external block hashes vLLM publishes for its
GPU cache, with every field vLLM's own events carry: token ids, parent hash, block size, LoRA,
extra keys (the cache salt, multimodal ids), session, group index and spec kind, and (vLLM 0.33
with lookahead hashing) the lookahead tokens. Each block is described while its request is
alive, when the core plans its store or fetch.

Media: the host pool is `CPU`, the disk `STORAGE` (`TierSpec.event_medium`); `ownership` names
the tier below the pool ("disk") or the shared pool ("shared_pool:NAME", which other engines on
the host fill too); a private pool's is None, as vLLM's primary CPU tier. A tier whose
`event_medium` is None is not published. See docs/events.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

try:  # vLLM 0.33: blocks hashed with lookahead tokens
    from vllm.v1.core.kv_cache_utils import generate_lookahead_block_hash_extra_keys
except ImportError:  # vLLM 0.32
    generate_lookahead_block_hash_extra_keys = None
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvconnector.offload.events import BlockChange
from kvconnector.offload.loads import POOL
from transfer.keys import DIGEST_BYTES
from transfer.registry import tier_spec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvconnector.offload.scheduler import OffloadScheduler

# vLLM 0.33 added the lookahead tokens a block's hash covers
_HAS_LOOKAHEAD = "lookahead_token_ids" in BlockStored.__struct_fields__


def events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (`--kv-events-config` with events enabled)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


class Source(NamedTuple):
    """What a request's blocks share, kept for as long as one of them is described: its block
    hashes and tokens (the request's own lists: what is computed of them never changes, and a
    block's slice is taken when it is published), LoRA, session, and the request itself where
    vLLM hashes more than tokens into its blocks (`extras`: on every block; `salted`: the
    cache salt, on the first)."""

    hashes: Sequence[bytes]
    tokens: Sequence[int]
    lora_id: int | None
    lora_name: str | None
    session_id: str | None
    request: Request | None  # for vLLM's extra keys, where there are any
    extras: bool
    salted: bool


# One block's description: its request's Source and its position there (plain tuples: a
# thousand are made a step)
BlockAbout = tuple[Source, int]


@dataclass(frozen=True)
class Medium:
    """How one source's blocks are published."""

    medium: str
    locality: str
    ownership: str | None


class ConnectorEvents:
    """Describes blocks for the core and turns its changes into vLLM's events (module doc)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 core: OffloadScheduler, tier_names: Sequence[str], pool: str | None) -> None:
        self.block_size = core.block_size
        self.media = {POOL: Medium(MEDIUM_CPU, "LOCAL",
                                   f"shared_pool:{pool}" if pool else None)}
        for name in tier_names:
            spec = tier_spec(name)
            if spec.event_medium is not None:
                self.media[name] = Medium(spec.event_medium, spec.event_locality, name)
        groups = kv_cache_config.kv_cache_groups
        self.multi_group = len(groups) > 1
        self.kinds = [(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                       get_kv_cache_spec_sliding_window(g.kv_cache_spec)) for g in groups]
        self.lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
        self._requests: dict[str, Request] = {}
        # request -> its Source and its block hash -> position
        self._sources: dict[str, tuple[Source, dict[bytes, int]]] = {}
        self.core = core
        core.enable_events(list(self.media), self.describe)

    # ---- requests ----------------------------------------------------------------------------

    def track(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def forget(self, req_id: str) -> None:
        """The request finished: its last stores were described when planned."""
        self._requests.pop(req_id, None)
        self._sources.pop(req_id, None)

    def _split(self, key: bytes) -> tuple[int, bytes]:
        """(group index, block hash) of a key (transfer.keys, with the group's prefix byte)."""
        if self.multi_group:
            return key[DIGEST_BYTES], key[DIGEST_BYTES + 1:]
        return 0, key[DIGEST_BYTES:]

    def _source(self, req_id: str) -> tuple[Source, dict[bytes, int]] | None:
        known = self._sources.get(req_id)
        if known is None:
            request = self._requests.get(req_id)
            if request is None:
                return None
            lora = request.lora_request
            # What vLLM hashes besides the tokens (generate_block_hash_extra_keys): multimodal
            # inputs, the LoRA, prompt embeddings on every block, the cache salt on the first.
            # A request with none of them has none on any block: no call per block.
            extras = bool(getattr(request, "mm_features", None) or lora is not None
                          or getattr(request, "prompt_embeds", None) is not None
                          or self.lookahead)
            salted = bool(getattr(request, "cache_salt", None))
            source = Source(request.block_hashes, request.all_token_ids,
                            lora.adapter_id if lora else None, lora.name if lora else None,
                            getattr(request, "session_id", None),
                            request if extras or salted else None, extras, salted)
            known = self._sources[req_id] = (source, {})
        hashes, positions = known[0].hashes, known[1]
        for i in range(len(positions), len(hashes)):  # blocks hashed since the last call
            positions.setdefault(hashes[i], i)  # a BlockHash: bytes
        return known

    def describe(self, req_id: str, keys: Sequence[bytes]) -> list[BlockAbout | None]:
        """Each key's description from its request (None where the request has no such block):
        a reference to what the request's blocks share and the block's position."""
        known = self._source(req_id)
        if known is None:
            return [None] * len(keys)
        source, positions = known
        skip = DIGEST_BYTES + (1 if self.multi_group else 0)
        found = [positions.get(key[skip:]) for key in keys]
        return [None if i is None else (source, i) for i in found]

    # ---- the events --------------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """This step's events: the core's changes, each a few batched events."""
        events: list[KVCacheEvent] = []
        for change in self.core.take_block_changes():
            medium = self.media[change.source]
            if change.stored:
                events += self._stored(change, medium)
            else:
                events += self._removed(change, medium)
        return events

    def _removed(self, change: BlockChange, medium: Medium) -> list[KVCacheEvent]:
        if not self.multi_group:
            hashes = [external_hash(key[DIGEST_BYTES:]) for key in change.keys]
            return [BlockRemoved(block_hashes=hashes, medium=medium.medium, group_idx=0,
                                 locality=medium.locality, ownership=medium.ownership)]
        by_group: dict[int, list[Any]] = {}
        for key in change.keys:
            group, block_hash = self._split(key)
            by_group.setdefault(group, []).append(external_hash(block_hash))
        return [BlockRemoved(block_hashes=hashes, medium=medium.medium, group_idx=group,
                             locality=medium.locality, ownership=medium.ownership)
                for group, hashes in by_group.items()]

    def _stored(self, change: BlockChange, medium: Medium) -> list[KVCacheEvent]:
        """One BlockStored per run of consecutive blocks of one request and group (each the
        parent of the next); a block described by no request goes alone, with its hash and
        group only."""
        events: list[KVCacheEvent] = []
        run: list[bytes] = []  # keys of consecutive blocks
        source, group, last = None, -1, -1
        for key, about in zip(change.keys, change.about, strict=True):
            key_group = key[DIGEST_BYTES] if self.multi_group else 0
            if about is None or about[0] is not source or about[1] != last + 1 \
                    or key_group != group:
                if run:
                    events.append(self._event(run, source, last - len(run) + 1, group, medium))
                run = []
                source, last = (None, -1) if about is None else about
                group = key_group
            else:
                last += 1
            run.append(key)
            if about is None:  # undescribed: alone
                events.append(self._event(run, None, 0, group, medium))
                run = []
        if run:
            events.append(self._event(run, source, last - len(run) + 1, group, medium))
        return events

    def _event(self, keys: list[bytes], source: Source | None, first: int, group: int,
               medium: Medium) -> KVCacheEvent:
        """The BlockStored of `keys`, blocks `first`, `first + 1`, ... of `source`'s request
        (None: blocks no request describes, published with their hash and group only)."""
        size, skip = self.block_size, DIGEST_BYTES + (1 if self.multi_group else 0)
        kind, window = self.kinds[group]
        fields: dict[str, Any] = dict(
            block_hashes=[external_hash(key[skip:]) for key in keys],
            medium=medium.medium, group_idx=group, kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window, locality=medium.locality,
            ownership=medium.ownership)
        if source is None:  # another engine's block: its hash and group only
            return BlockStored(parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                               lora_name=None, **fields)
        positions = range(first, first + len(keys))
        extra_keys = None
        if source.request is not None and (source.extras or first == 0):
            extra_keys = self._extra_keys(source, list(positions))
        if _HAS_LOOKAHEAD and self.lookahead:
            fields["lookahead_token_ids"] = [
                list(source.tokens[(p + 1) * size:(p + 1) * size + self.lookahead])
                for p in positions]
        return BlockStored(
            parent_block_hash=external_hash(source.hashes[first - 1]) if first else None,
            token_ids=list(source.tokens[first * size:(first + len(keys)) * size]),
            block_size=size, lora_id=source.lora_id, lora_name=source.lora_name,
            extra_keys=extra_keys, session_id=source.session_id, **fields)

    def _extra_keys(self, source: Source, positions: list[int]) -> list[Any] | None:
        """vLLM's extra keys of each block, as its own events publish them."""
        size, request = self.block_size, source.request
        keys = []
        for p in positions:
            start, end = p * size, (p + 1) * size
            if self.lookahead:
                extra, _ = generate_lookahead_block_hash_extra_keys(
                    request, start, end, end + self.lookahead, 0)
            else:
                extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
            keys.append(extra)
        return to_event_extra_keys(keys)


def external_hash(block_hash: bytes) -> Any:
    """The hash as vLLM publishes it (vLLM's maybe_convert_block_hash: bytes, or the low 64
    bits of their big-endian int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, read once: vLLM's
    reads the environment at every call)."""
    if _INT_HASHES:
        return int.from_bytes(block_hash, "big") & _LOW_64
    return block_hash


_LOW_64 = (1 << 64) - 1
_INT_HASHES = isinstance(maybe_convert_block_hash(BlockHash(b"\x01")), int)
