"""`kv_connector_extra_config` checked at the first call vLLM makes into the connector: every key
and value (kvconnector/vllm/options.py), refused with one line naming the key, what it got and
what it accepts; through vLLM's real config code, where it asks the connector's classmethods
before any connector or KV cache exists (kvconnector/vllm/connector.py); and by the CPU
launcher (examples/vllm_cpu.py) before vLLM starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from vllm.config import (  # noqa: E402
    CompilationConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    get_kv_connector_cache_layout,
)
from vllm.platforms import current_platform  # noqa: E402

from kvconnector.vllm.connector import CrossLayerOffloadConnector  # noqa: E402
from kvconnector.vllm.options import ERROR_PREFIX, ConnectorOptions  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

GIB = 1 << 30
KEYS = ", ".join(field.name for field in dataclasses.fields(ConnectorOptions))
HOST_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

# A user's three mistakes, and the whole message each gets.
MISTAKES = [
    ({"cpu_bytes": "lots"}, "cpu_bytes must be a positive integer of bytes, got 'lots'"),
    ({"cpu_byte": GIB}, f"unknown key 'cpu_byte' (did you mean 'cpu_bytes'?); accepted keys: "
                        f"{KEYS}"),
    ({"cpu_bytes": GIB, "eviction": "mru"},
     "eviction must be one of ('lru', 'arc'), got 'mru' (did you mean 'lru'?)"),
]


def refusal(extra: Any) -> str:
    """The message parse() refuses `extra` with, checked to be one line of the connector's."""
    with pytest.raises(ValueError) as caught:
        ConnectorOptions.parse(extra)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(ERROR_PREFIX), message
    return message.removeprefix(ERROR_PREFIX)


@pytest.mark.parametrize(("extra", "message"), MISTAKES)
def test_a_mistake_is_one_line_naming_the_key_and_what_it_accepts(extra: dict,
                                                                  message: str) -> None:
    assert refusal(extra) == message


@pytest.mark.parametrize(("extra", "message"), [
    ({"cpu_bytes": GIB, "cpu_gb": 2, "evict": "lru"},
     f"unknown keys 'cpu_gb' (did you mean 'cpu_bytes'?), 'evict' (did you mean 'eviction'?); "
     f"accepted keys: {KEYS}"),
    ({"cpu_bytes": GIB, 7: 1}, f"unknown key 7; accepted keys: {KEYS}"),
    ({"cpu_bytes": GIB, "max_store_bytes": True},
     "max_store_bytes must be a positive integer of bytes, got True"),
    ({"cpu_bytes": 2.5 * GIB}, "cpu_bytes must be a positive integer of bytes, got 2684354560.0"),
    ({"cpu_bytes": GIB, "layout": "blnhc"},
     "layout must be one of ('auto', 'engine', 'BLNHC', 'BLHNC', 'BHLNC'), got 'blnhc' "
     "(did you mean 'BLNHC'?)"),
    ({"cpu_bytes": GIB, "copy_backend": ["dma"]},
     "copy_backend must be one of ('auto', 'thread', 'dma', 'sm'), got ['dma']"),
    ({"cpu_bytes": GIB, "eviction": None}, "eviction must be one of ('lru', 'arc'), got None"),
    ({"cpu_bytes": GIB, "remote_url": "tcp://127.0.0.1:1", "remote_timeout_s": float("nan")},
     "remote_timeout_s must be a positive number of seconds, got nan"),
    ({"cpu_bytes": GIB, "remote_url": "tcp://127.0.0.1:1",
      "remote_lookup_deadline_s": float("inf")},
     "remote_lookup_deadline_s must be a positive number of seconds, got inf"),
    ({"cpu_bytes": GIB, "remote_url": "tcp://127.0.0.1:1", "remote_timeout_s": "5"},
     "remote_timeout_s must be a positive number of seconds, got '5'"),
    ({"cpu_bytes": GIB, "remote_only": "yes"}, "remote_only must be true or false, got 'yes'"),
    ({"cpu_bytes": GIB, "remote_url": 7000}, "remote_url must be a non-empty string, got 7000"),
    ({"cpu_bytes": GIB, "remote_url": "tcp://127.0.0.1:1", "remote_security": "secret",
      "remote_secret_file": 3}, "remote_secret_file must be a non-empty string, got 3"),
    ({"cpu_bytes": GIB, "remote_url": "tcp://127.0.0.1:1", "remote_security": "plain"},
     "remote_security must be one of ('none', 'secret', 'curve'), got 'plain'"),
    ({"cpu_bytes": GIB, "disk_path": "/tmp/x", "disk_bytes": GIB, "disk_write_policy": "thru"},
     "disk_write_policy must be one of ('evict', 'through'), got 'thru' "
     "(did you mean 'through'?)"),
    ({"cpu_bytes": None}, "needs exactly one of 'cpu_bytes' (host pool bytes per worker, e.g. "
                          "68719476736 for 64 GiB) and 'pool' (a shared pool's name), got None "
                          "and None"),
    (["cpu_bytes", GIB], "must be a JSON object of keys, got ['cpu_bytes', 1073741824]"),
])
def test_every_key_takes_only_its_kind_of_value(extra: Any, message: str) -> None:
    assert refusal(extra) == message


def test_a_pool_larger_than_the_hosts_memory_is_refused() -> None:
    too_big = HOST_MEMORY + GIB
    assert re.fullmatch(rf"cpu_bytes {too_big} \([0-9.]+ GiB\) is more than this host's memory "
                        r"\([0-9.]+ GiB\): each worker's pool is held in RAM",
                        refusal({"cpu_bytes": too_big}))


def test_a_huge_bad_value_is_quoted_by_a_short_prefix() -> None:
    message = refusal({"cpu_bytes": "x" * 100_000})
    assert message.endswith("... (100002 chars)") and len(message) < 200
    message = refusal({"cpu_bytes": GIB, "k" * 100_000: 1})
    assert "(100002 chars)" in message and len(message) < 200 + len(KEYS)


def test_null_leaves_an_optional_key_unset() -> None:
    options = ConnectorOptions.parse({"cpu_bytes": GIB, "remote_url": None, "disk_path": None,
                                      "pool": None, "disk_bytes": None})
    assert options == ConnectorOptions(cpu_bytes=GIB)


# -- through vLLM's config code ------------------------------------------------------------------
def _good_config(model_dir: str) -> VllmConfig:
    return h.make_vllm_config(h.EngineSetup(model_dir=model_dir,
                                            extra_config={"cpu_bytes": GIB}))


@pytest.mark.parametrize(("extra", "message"), MISTAKES)
def test_the_layout_query_refuses_bad_options_before_any_connector_exists(
        model_dir: str, extra: dict, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine core asks the connector class for its layout (get_kv_connector_cache_layout,
    from resolve_kv_cache_layout) before it sizes the KV cache or builds the scheduler."""
    def no_instance(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a connector was built")

    config = _good_config(model_dir)
    assert get_kv_connector_cache_layout(config) == "BLNHC"  # TRITON_ATTN, good options
    config.kv_transfer_config.kv_connector_extra_config = dict(extra)
    monkeypatch.setattr(CrossLayerOffloadConnector, "__init__", no_instance)
    with pytest.raises(ValueError) as caught:
        get_kv_connector_cache_layout(config)
    assert str(caught.value) == ERROR_PREFIX + message


def _config_with_full_cuda_graphs(model_dir: str, extra: dict) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=1024),
        compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="CrossLayerOffloadConnector",
            kv_connector_module_path="kvconnector.vllm", kv_role="kv_both",
            kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))


@pytest.mark.parametrize(("extra", "message"), MISTAKES)
def test_with_full_cuda_graphs_vllm_refuses_bad_options_while_building_its_config(
        model_dir: str, extra: dict, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (full CUDA graphs, vLLM's default there) VllmConfig asks the connector class
    whether it needs piecewise graphs: the options fail there, in the launching process."""
    # The platform here has no graph mode; CUDA's has (vllm/platforms/cuda.py).
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode",
                        classmethod(lambda cls: True))
    good = _config_with_full_cuda_graphs(model_dir, {"cpu_bytes": GIB})
    # Whole blocks move around the forward, never inside it: the graphs stay full.
    assert good.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match=re.escape(ERROR_PREFIX + message)):
        _config_with_full_cuda_graphs(model_dir, dict(extra))


def test_good_options_ask_for_no_piecewise_graphs() -> None:
    assert CrossLayerOffloadConnector.requires_piecewise_for_cudagraph({"cpu_bytes": GIB}) \
        is False


@pytest.mark.parametrize("key", ["remote_secret_file", "remote_curve_key_pair",
                                 "remote_curve_server_key"])
def test_a_security_file_that_is_not_there_is_named(tmp_path: Path, key: str) -> None:
    # Read only when the first client connects, once the model is loaded: checked here.
    (tmp_path / "present").write_text("x")
    extra = {"cpu_bytes": GIB, "remote_url": "tcp://127.0.0.1:1",
             "remote_security": "secret" if key == "remote_secret_file" else "curve",
             "remote_secret_file": None, "remote_curve_key_pair": None,
             "remote_curve_server_key": None}
    if key != "remote_secret_file":
        extra.update(remote_curve_key_pair=str(tmp_path / "present"),
                     remote_curve_server_key=str(tmp_path / "present"))
    for path in (str(tmp_path / "absent"), str(tmp_path)):  # nothing there; a directory
        assert refusal({**extra, key: path}) == f"{key} {path!r} is not a readable file"


# -- the CPU launcher (examples/vllm_cpu.py) -----------------------------------------------------
LAUNCHER = Path(__file__).resolve().parents[2] / "examples" / "vllm_cpu.py"


def _transfer_config(extra: dict, module_path: str = "kvconnector.vllm") -> str:
    return json.dumps({"kv_connector": "CrossLayerOffloadConnector",
                       "kv_connector_module_path": module_path, "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})


@pytest.mark.parametrize(("extra", "message"), MISTAKES)
def test_the_cpu_launcher_refuses_bad_options_before_vllm_starts(extra: dict,
                                                                 message: str) -> None:
    """On a CPU vLLM asks the connector first once a worker has loaded the model (most of a
    minute): the launcher checks before it, one line and exit code 2, vLLM never started."""
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), "serve", "/no/such/model", "--block-size", "32",
         "--kv-transfer-config", _transfer_config(extra)],
        capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"error: {ERROR_PREFIX}{message}\n"


def _launcher() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_cpu_launcher", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launcher_reads_each_spelling_of_the_flag_and_leaves_the_rest_to_vllm() -> None:
    refusal = _launcher().connector_refusal
    bad, good = _transfer_config({"cpu_byte": GIB}), _transfer_config({"cpu_bytes": GIB})
    expected = ERROR_PREFIX + MISTAKES[1][1]
    assert refusal(["serve", "m", "--kv-transfer-config", bad]) == expected
    assert refusal(["serve", "m", f"--kv-transfer-config={bad}"]) == expected
    assert refusal(["serve", "m", "--kv_transfer_config", bad]) == expected
    assert refusal(["serve", "m", "--kv-transfer-config", good]) is None
    # Another connector's options, malformed JSON (vLLM's parser names it), no value, no flag.
    assert refusal(["serve", "m", "--kv-transfer-config",
                    _transfer_config({"cpu_byte": 1}, module_path="other.module")]) is None
    assert refusal(["serve", "m", "--kv-transfer-config", "{not json"]) is None
    assert refusal(["serve", "m", "--kv-transfer-config"]) is None
    assert refusal(["bench", "serve", "--base-url", "http://127.0.0.1:8000"]) is None
