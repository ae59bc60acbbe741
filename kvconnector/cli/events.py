"""`kvconnector events watch ENDPOINT`: a router operator's first check that an engine's KV
events flow. It subscribes to vLLM's event publisher (`--kv-events-config`, zmq PUB: topic,
sequence number, msgpack `KVEventBatch`), replays every event into the blocks each medium holds,
and prints a line a batch: the running per-medium count and the batch's changes, with the first
few events decoded in full. Needs no vLLM: the batches are plain msgpack.

`EventView` is the replay: what a router would believe the engine holds, per medium. vLLM's
`AllBlocksCleared` is its GPU cache's (the connector publishes per-tier removals instead).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgpack

GPU = "GPU"


@dataclass
class EventView:
    """Blocks per medium, as (group index, block hash), from a replay of decoded events."""

    held: dict[str, set[tuple[int | None, Any]]] = field(default_factory=dict)

    def apply(self, event: dict[str, Any]) -> tuple[str | None, int]:
        """Apply one decoded event; returns (its medium, blocks it added, negative: removed)."""
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            gpu = self.held.setdefault(GPU, set())
            cleared = len(gpu)
            gpu.clear()
            return GPU, -cleared
        medium = event.get("medium") or GPU  # vLLM's GPU events may leave it unset
        held = self.held.setdefault(medium, set())
        blocks = [(event.get("group_idx"), _hashable(h)) for h in event.get("block_hashes", ())]
        before = len(held)
        if kind == "BlockStored":
            held.update(blocks)
        elif kind == "BlockRemoved":
            held.difference_update(blocks)
        return medium, len(held) - before

    def counts(self) -> dict[str, int]:
        return {medium: len(blocks) for medium, blocks in sorted(self.held.items())}


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """(timestamp, events, data parallel rank) of one published KVEventBatch."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, events = batch[0], batch[1]
    return ts, list(events), batch[2] if len(batch) > 2 else None


def describe_event(event: dict[str, Any]) -> str:
    """One line for an event: kind, medium, where from, blocks, tokens, parent."""
    kind = event.get("type", "?")
    if kind == "AllBlocksCleared":
        return kind
    hashes = event.get("block_hashes", [])
    parts = [kind, str(event.get("medium") or GPU)]
    for name in ("locality", "ownership"):
        if event.get(name):
            parts.append(f"{name}={event[name]}")
    parts.append(f"group={event.get('group_idx')}")
    parts.append(f"blocks={len(hashes)}")
    if hashes:
        parts.append(f"first={_short(hashes[0])}")
    if kind == "BlockStored":
        parts.append(f"tokens={len(event.get('token_ids') or [])}")
        parts.append(f"block_size={event.get('block_size')}")
        parts.append(f"parent={_short(event.get('parent_block_hash'))}")
        if event.get("kv_cache_spec_kind"):
            parts.append(f"kind={event['kv_cache_spec_kind']}")
        if event.get("lora_name"):
            parts.append(f"lora={event['lora_name']}")
    return " ".join(parts)


def watch_batches(messages: Iterable[tuple[bytes, bytes, bytes]], out: TextIO,
                  show: int = 5) -> EventView:
    """Replay (topic, sequence, payload) messages, printing a line a batch and the first
    `show` events in full; a gap in the sequence numbers is reported (the view may be stale:
    vLLM's replay endpoint can fill it)."""
    view, shown, last_seq = EventView(), 0, None
    for _, seq_bytes, payload in messages:
        seq = int.from_bytes(seq_bytes, "big")
        if last_seq is not None and seq != last_seq + 1:
            out.write(f"missed {seq - last_seq - 1} batch(es) before seq {seq}: counts may be "
                      f"stale\n")
        last_seq = seq
        _, events, _ = decode_batch(payload)
        changes: dict[str, int] = {}
        for event in events:
            medium, delta = view.apply(event)
            if medium is not None:
                changes[medium] = changes.get(medium, 0) + delta
            if shown < show:
                out.write(f"  {describe_event(event)}\n")
                shown += 1
        delta_text = " ".join(f"{m}{d:+d}" for m, d in sorted(changes.items()) if d)
        held_text = " ".join(f"{m}={n}" for m, n in view.counts().items())
        out.write(f"seq {seq}: {len(events)} event(s) {delta_text or '(no change)'} | held "
                  f"{held_text}\n")
        out.flush()
    return view


def subscriber(endpoint: str, topic: str = "", bind: bool = False) -> Any:
    """A zmq SUB socket for vLLM's publisher at `endpoint`; `bind`: bind it instead (vLLM's
    publisher connects to an endpoint without a wildcard, and binds one with)."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    if bind:
        sub.bind(endpoint)
    else:
        sub.connect(endpoint)
    return sub


def _subscribe(endpoint: str, topic: str, seconds: float, batches: int,
               bind: bool) -> Iterable[tuple[bytes, bytes, bytes]]:
    sub = subscriber(endpoint, topic, bind)  # now: connected before the first line prints
    return _messages(sub, time.monotonic() + seconds if seconds > 0 else None, batches)


def _messages(sub: Any, deadline: float | None,
              batches: int) -> Iterable[tuple[bytes, bytes, bytes]]:
    seen = 0
    try:
        while batches <= 0 or seen < batches:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if not sub.poll(timeout=200 if left is None else min(200, int(left * 1000) + 1)):
                continue
            frames = sub.recv_multipart()
            if len(frames) != 3:
                continue  # not a vLLM event batch
            seen += 1
            yield frames[0], frames[1], frames[2]
    finally:
        sub.close()


def watch(args: argparse.Namespace) -> int:
    messages = _subscribe(args.endpoint, args.topic, args.seconds, args.batches, args.bind)
    print(f"watching {args.endpoint} (topic {args.topic!r}); Ctrl-C to stop", flush=True)
    try:
        view = watch_batches(messages, sys.stdout, args.show)
    except KeyboardInterrupt:
        return 0
    print("held " + " ".join(f"{m}={n}" for m, n in view.counts().items()), flush=True)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("events", help="read an engine's KV events (vLLM's "
                                            "--kv-events-config)")
    verbs = parser.add_subparsers(dest="events_command", required=True)
    w = verbs.add_parser("watch", help="print a running per-medium block count and a few "
                                       "decoded events")
    w.add_argument("endpoint", help="the publisher's endpoint, e.g. tcp://127.0.0.1:5557")
    w.add_argument("--bind", action="store_true",
                   help="bind ENDPOINT and let the engine connect (a kv-events-config endpoint "
                        "without a wildcard, e.g. tcp://127.0.0.1:5557, makes vLLM connect)")
    w.add_argument("--topic", default="", help="the publisher's topic (default: every topic)")
    w.add_argument("--show", type=int, default=5, help="events to print in full (default 5)")
    w.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: never)")
    w.add_argument("--batches", type=int, default=0, help="stop after this many (0: never)")
    w.set_defaults(func=watch)


def _hashable(block_hash: Any) -> Any:
    return bytes(block_hash) if isinstance(block_hash, bytearray | list) else block_hash


def _short(block_hash: Any) -> str:
    if block_hash is None:
        return "none"
    if isinstance(block_hash, bytes | bytearray):
        return block_hash[:6].hex()
    return f"{block_hash:#x}"[:14] if isinstance(block_hash, int) else str(block_hash)[:14]
