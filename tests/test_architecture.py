"""The parts' import rules, read from the source with `ast` (lazy and TYPE_CHECKING imports count).

- the layout core (`kvconnector.layout`) imports neither `transfer` nor vLLM nor any other part;
- `transfer` imports, of `kvconnector`, only the layout core, and never vLLM;
- the offload cores (`kvconnector.offload`) are vLLM-free;
- nothing below the adapter (`kvconnector.vllm`) imports it, the benchmark and the CLI included;
- no two modules reach each other through imports (no cycles);
- the offload core imports no tier package (a registered tier's folder, or the shared pool's)
  nor the registry, and its code names no tier (only comments and docstrings may);
- a tier package imports no other tier package;
- the local servers (`kvconnector.servers`: for the bench, the examples and the tests) are used
  by no part of the connector, and use none of it above `transfer`.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from transfer.registry import registered_tiers

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvconnector", "transfer")
OFFLOAD_CORE = "kvconnector.offload"
# Every registered tier's folder (where its planner lives), and the shared pool's: the pool the
# core drives through its index and mapping protocols, never by name.
TIER_PACKAGES = tuple(sorted({spec.make_planner.__module__.rpartition(".")[0]
                              for spec in registered_tiers()} | {"transfer.shared"}))
TIER_WORDS = tuple(sorted({spec.name for spec in registered_tiers()} | {"shared"}))

# module prefix -> imports it may not make (prefixes; "vllm" is the vLLM package itself)
FORBIDDEN = {
    "kvconnector.layout": ("transfer", "vllm", "kvconnector.offload", "kvconnector.vllm",
                           "kvconnector.cli", "kvconnector.bench"),
    "transfer": ("vllm", "kvconnector.offload", "kvconnector.vllm", "kvconnector.cli",
                 "kvconnector.bench", "kvconnector.servers"),
    OFFLOAD_CORE: ("vllm", "kvconnector.vllm", "kvconnector.cli", "kvconnector.bench",
                   "kvconnector.servers", "transfer.registry", *TIER_PACKAGES),
    "kvconnector.vllm": ("kvconnector.servers", "kvconnector.bench", "kvconnector.cli"),
    # local servers for the bench, the examples and the tests: never part of the connector
    "kvconnector.servers": ("vllm", "kvconnector.offload", "kvconnector.vllm",
                            "kvconnector.bench", "kvconnector.cli"),
    **{tier: tuple(other for other in TIER_PACKAGES if other != tier) for tier in TIER_PACKAGES},
    "kvconnector.bench": ("vllm", "kvconnector.vllm"),
    "kvconnector.cli": ("vllm", "kvconnector.vllm"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, source: str, known: Iterable[str]) -> set[str]:
    """Every module `source` imports, anywhere in it; `from a import b` names `a.b` when that
    is a module of ours, else `a`."""
    known = set(known)
    package = name if f"{name}.__init__" in known else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def violations(sources: Mapping[str, str]) -> list[str]:
    """Broken layering rules and import cycles among `sources` (module name -> source)."""
    known = set(sources)
    graph = {name: imports_of(name, text, known) for name, text in sources.items()}
    found = []
    for name, targets in sorted(graph.items()):
        for prefix, banned in FORBIDDEN.items():
            if name == prefix or name.startswith(prefix + "."):
                found += [f"{name} imports {t}" for t in sorted(targets)
                          if any(t == b or t.startswith(b + ".") for b in banned)]
    for name, text in sorted(sources.items()):
        if name == OFFLOAD_CORE or name.startswith(OFFLOAD_CORE + "."):
            found += [f"{name} names tier {word!r} in its code" for word in tier_words(text)]
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(
        {n: {t for t in ts if t in known and t != n} for n, ts in graph.items()})]
    return found


def tier_words(source: str) -> list[str]:
    """The tier names (TIER_WORDS, as words or parts of identifiers) that `source`'s code uses:
    names, strings and attributes count; comments and docstrings do not."""
    doc_lines = {node.body[0].value.lineno for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef |
                               ast.AsyncFunctionDef)
                 and node.body and isinstance(node.body[0], ast.Expr)
                 and isinstance(node.body[0].value, ast.Constant)
                 and isinstance(node.body[0].value.value, str)}
    code = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            continue
        if token.type == tokenize.STRING and token.start[0] in doc_lines:
            continue
        code.append(token.string)
    text = " ".join(code).lower()
    return [word for word in TIER_WORDS if re.search(rf"(?<![a-z]){word}(?![a-z])", text)]


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_tree_keeps_the_import_rules() -> None:
    sources = project_sources()
    assert {"kvconnector.layout.allocator", "transfer.pool", "kvconnector.vllm.connector",
            "transfer.copy.factory", "transfer.remote.factory"} <= set(sources)
    assert violations(sources) == []


@pytest.mark.parametrize(("sources", "expected"), [
    ({"kvconnector.layout.views": "from transfer.pool import HostPool",
      "transfer.pool": ""}, ["kvconnector.layout.views imports transfer.pool"]),
    ({"transfer.pool": "def f():\n    import kvconnector.vllm.options\n",
      "kvconnector.vllm.options": ""},
     ["transfer.pool imports kvconnector.vllm.options"]),
    ({"kvconnector.offload.worker": "if True:\n    from vllm.config import VllmConfig\n"},
     ["kvconnector.offload.worker imports vllm.config"]),
    ({"kvconnector.bench.movers": "from kvconnector.vllm import connector",
      "kvconnector.vllm.connector": ""},
     ["kvconnector.bench.movers imports kvconnector.vllm.connector"]),
    ({"kvconnector.offload.scheduler": "from transfer.disk.planner import DiskPlanner",
      "transfer.disk.planner": ""},
     ["kvconnector.offload.scheduler imports transfer.disk.planner",
      "kvconnector.offload.scheduler names tier 'disk' in its code"]),
    ({"kvconnector.offload.worker": '"""The disk tier, said in a docstring."""\n'
                                    "# and in a comment: remote, shared\n"
                                    "def f(job):\n    return job.disk_keys\n"},
     ["kvconnector.offload.worker names tier 'disk' in its code"]),
    ({"kvconnector.offload.loads": "x = {'remote': 1}\n"},
     ["kvconnector.offload.loads names tier 'remote' in its code"]),
    ({"transfer.remote.worker": "from transfer.disk.io import DiskIO",
      "transfer.disk.io": ""}, ["transfer.remote.worker imports transfer.disk.io"]),
    ({"transfer.copy.base": "def f():\n    from transfer.copy import cuda\n",
      "transfer.copy.cuda": "from transfer.copy.base import Lane",
      "transfer.copy": ""}, ["import cycle: transfer.copy.base -> transfer.copy.cuda"]),
])
def test_the_check_finds_each_kind_of_violation(sources: dict[str, str],
                                                expected: list[str]) -> None:
    assert violations(sources) == expected


def test_importing_a_lower_part_loads_no_upper_one() -> None:
    # What the interpreter really loads, parent packages' __init__ included.
    code = (
        "import sys\n"
        "import kvconnector.layout, kvconnector.layout.recognize, kvconnector.layout.registry\n"
        "core = sorted(m for m in sys.modules if m.split('.')[0] in ('transfer', 'vllm')\n"
        "              or m.startswith(('kvconnector.offload', 'kvconnector.vllm.')))\n"
        "import transfer.pool, transfer.engine, transfer.block_index, transfer.copy.factory\n"
        "import transfer.remote.factory, transfer.remote.async_client\n"
        "up = sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith(\n"
        "    ('kvconnector.offload', 'kvconnector.vllm', 'kvconnector.cli',\n"
        "     'kvconnector.bench')))\n"
        "print(core, up)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[] []"


def test_the_store_and_its_clients_start_without_torch() -> None:
    # `kvconnector store serve` is a process of its own (tests start it under a deadline): the
    # package, the CLI and the store must not pull in torch (5-12 s on a busy 2-core machine).
    code = ("import sys, kvconnector, kvconnector.cli.store, transfer.remote.factory\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
