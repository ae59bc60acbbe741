"""Fixtures of the engine tier (marker `engine`; see tests/engine/engine_support.py).

`tiny_model`: the tiny Llama directory (config, random weights, tokenizer), written once per
session. `vllm_cache_root` (autouse): vLLM writes its caches under a temporary VLLM_CACHE_ROOT,
never ~/.cache/vllm, and nothing is fetched from a hub (HF_HUB_OFFLINE=1). `store`: a
`kvconnector store serve` process on loopback for the module, stopped after it.
`finished_hashes`: the block hashes of each request of the module's `llm` as it finishes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    saved = {name: os.environ.get(name) for name in ("VLLM_CACHE_ROOT", "HF_HUB_OFFLINE")}
    root = str(tmp_path_factory.mktemp("vllm-cache"))
    os.environ.update(VLLM_CACHE_ROOT=root, HF_HUB_OFFLINE="1")
    yield root
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-weights"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A StoreProcess (kvconnector/servers/store.py) serving `url`: kill() and start()
    restart it empty on the same URL."""
    from kvconnector.servers.store import StoreProcess

    log = tmp_path_factory.mktemp("store") / "store.log"
    with StoreProcess(log, capacity="64MiB") as process:
        yield process


@pytest.fixture
def finished_hashes(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[bytes]]:
    """The block hashes of each request as it finishes (to find its slots in the index)."""
    from engine_support import record_finished_hashes

    return record_finished_hashes(llm, monkeypatch)
