"""Load for running the suite on a busy machine: vLLM's CPU engine with the connector serving a
tiny random-weight Llama in a loop (1,000-token prompts, 8 of them in turn, 32 tokens each), for
at most LIMIT seconds, then it exits by itself. Not a test; run it from the engine venv beside a
fresh-clone `.ci/run`:

    HF_HUB_OFFLINE=1 .venv-vllm-cpu/bin/python tests/engine/machine_load.py 5400 &
"""

from __future__ import annotations

import random
import sys
import tempfile
import time

from engine_support import generate, running_llm
from tiny_llama import prompt_ids, write_tiny_llama


def main(limit_s: float) -> None:
    model = write_tiny_llama(tempfile.mkdtemp(prefix="machine-load-llama-"))
    start, requests = time.monotonic(), 0
    with running_llm(model, {"cpu_bytes": 64 << 20}) as llm:
        while time.monotonic() - start < limit_s:
            generate(llm, prompt_ids(random.randrange(8), 1000), max_tokens=32)
            requests += 1
            if requests % 20 == 0:
                print(f"{time.monotonic() - start:.0f} s: {requests} requests", flush=True)
    print(f"machine load done: {requests} requests", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0)
