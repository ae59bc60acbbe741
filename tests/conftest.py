"""Shared pytest wiring: the `gpu` and `vllm` markers.

`gpu` tests skip cleanly without CUDA. `vllm` tests skip where vLLM is not importable, except
when KVCONNECTOR_REQUIRE_VLLM=1 (set by .ci/run): then a missing vLLM is an error, so CI can never
pass by silently skipping the integration tests.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    has_vllm = _vllm_available()
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("vllm") and not has_vllm:
            # With KVCONNECTOR_REQUIRE_VLLM=1 pytest_sessionstart has already failed the run.
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed"))


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("KVCONNECTOR_REQUIRE_VLLM") == "1" and not _vllm_available():
        raise pytest.UsageError(
            "KVCONNECTOR_REQUIRE_VLLM=1 but vLLM is not importable: install vllm==0.32.0"
        )
