"""The runnable examples run to the end and print their summary (so they cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 120


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
