"""`kvconnector events watch`: the CLI subscribed to vLLM's real zmq event publisher on
loopback, replaying its batches into per-medium counts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvconnector.cli.events import EventView, decode_batch, describe_event  # noqa: E402

pytestmark = pytest.mark.vllm


def stored(hashes: list[int], medium: str, **fields: object) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None,
                       token_ids=list(range(16 * len(hashes))), block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=0, **fields)


BATCHES = [
    [stored([1, 2, 3], "GPU"), stored([1, 2], "CPU", locality="LOCAL")],
    [stored([9], "STORAGE", locality="LOCAL", ownership="disk"),
     BlockRemoved(block_hashes=[2], medium="CPU", group_idx=0)],
    [AllBlocksCleared()],
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_watch_counts_each_medium_from_vllms_publisher() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # The watcher binds on loopback; vLLM's publisher connects to an endpoint without a wildcard.
    watcher = subprocess.Popen(
        [sys.executable, "-m", "kvconnector", "events", "watch", endpoint, "--bind",
         "--batches", "3", "--seconds", "60", "--show", "2"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    publisher = None
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().startswith("watching")
        publisher = ZmqEventPublisher(0, endpoint=endpoint)
        time.sleep(1.5)  # a SUB socket gets what is published once the two have joined
        for events in BATCHES:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
        if publisher is not None:
            publisher.shutdown()
    assert watcher.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("  BlockStored GPU group=0 blocks=3")
    assert lines[1].startswith("  BlockStored CPU locality=LOCAL group=0 blocks=2")
    assert lines[2] == "seq 0: 2 event(s) CPU+2 GPU+3 | held CPU=2 GPU=3"
    assert lines[3] == "seq 1: 2 event(s) CPU-1 STORAGE+1 | held CPU=1 GPU=3 STORAGE=1"
    assert lines[4] == "seq 2: 1 event(s) GPU-3 | held CPU=1 GPU=0 STORAGE=1"
    assert lines[5] == "held CPU=1 GPU=0 STORAGE=1"


def test_the_view_decodes_what_vllm_encodes() -> None:
    import msgspec

    view = EventView()
    for events in BATCHES[:2]:
        _, decoded, _ = decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events)))
        for event in decoded:
            view.apply(event)
    assert view.held == {"GPU": {(0, 1), (0, 2), (0, 3)}, "CPU": {(0, 1)}, "STORAGE": {(0, 9)}}
    line = describe_event(msgspec.to_builtins(stored([9], "STORAGE", ownership="disk")) | {
        "type": "BlockStored"})
    assert "ownership=disk" in line and "tokens=16" in line
