"""`kvconnector backends`: the attention-backend registry (kvconnector.layout.registry) as a
table or as JSON, with the layouts each backend accepts on this machine and the evidence for each
entry."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from kvconnector.layout import registry
from kvconnector.layout.registry import show_layouts

WIDTH = 100  # the table and its notes fit a 100-column terminal

def backend_rows(compute_capability: tuple[int, int] | None = None, use_vllm: bool = True
                 ) -> list[dict[str, Any]]:
    """One JSON-ready dict per backend listed to users (what `kvconnector backends` prints;
    test support such as the engine tier's reference backend is left out)."""
    rows = []
    for entry in registry.registered_backends(listed=True):
        declared = registry.declared_layouts(entry, compute_capability, use_vllm)
        rows.append({
            "name": entry.name, "view": entry.view.value, "reads_strides": entry.reads_strides,
            "layouts": None if declared.layouts is None else list(declared.layouts),
            "block_outermost": list(declared.block_outermost) if entry.reads_strides else [],
            "layouts_by_cc": {str(major): None if lay is None else list(lay)
                              for major, lay in entry.layouts_by_cc},
            "layouts_source": declared.source, "layouts_live": declared.live,
            "constraints": [{"kind": c.kind.value, "detail": c.detail, "evidence": c.evidence}
                            for c in entry.constraints],
            "evidence": entry.evidence, "vllm_class": entry.vllm_class,
        })
    return rows


def add_parser(subparsers: Any) -> None:
    """Register `kvconnector backends`: the registry as a table, or as JSON."""
    parser = subparsers.add_parser(
        "backends", help="attention backends and whether they may read block-major layer views",
        description=registry.__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--compute-capability", type=_cc_arg, metavar="MAJOR.MINOR",
                        help="the GPU's compute capability (default: vLLM's view of this "
                        "device, else what every device accepts)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="print the recorded layouts without importing vLLM")
    parser.set_defaults(func=_run_backends)


def _run_backends(args: argparse.Namespace) -> int:
    rows = backend_rows(args.compute_capability, use_vllm=not args.no_vllm)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("\n".join(table_lines(rows) + [""] + source_lines(rows) + [""] + evidence_lines(rows)))
    return 0


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One row per backend, a cell's values one a line, so the table fits WIDTH columns."""
    cells = [[["NAME"], ["STRIDES"], ["LAYOUTS"], ["BLOCK-OUTERMOST"], ["CONSTRAINTS"]]]
    for r in rows:
        cells.append([
            [r["name"]], ["yes" if r["reads_strides"] else "no"],
            [show_layouts(r["layouts"]), *(f"cc {major}: {show_layouts(lay)}"
                                           for major, lay in r["layouts_by_cc"].items())],
            [show_layouts(r["block_outermost"]) if r["block_outermost"] else "-"],
            [c["kind"] for c in r["constraints"]] or ["-"],
        ])
    widths = [max(len(line) for row in cells for line in row[i]) for i in range(len(cells[0]))]
    lines = []
    for row in cells:
        for depth in range(max(len(cell) for cell in row)):
            lines.append("  ".join((cell[depth] if depth < len(cell) else "").ljust(width)
                                   for cell, width in zip(row, widths, strict=True)).rstrip())
    return lines


def source_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where the LAYOUTS came from: a count of those read from the installed vLLM, and each
    other source once, with the backends it applies to."""
    recorded: dict[str, list[str]] = {}
    for r in rows:
        if not r["layouts_live"]:
            recorded.setdefault(r["layouts_source"], []).append(r["name"])
    live = len(rows) - sum(map(len, recorded.values()))
    lines = _wrap(f"LAYOUTS: {live} of {len(rows)} from the installed vLLM's "
                  f"supported_kv_cache_layouts(){'; the others:' if recorded else ''}", "")
    for source, names in recorded.items():
        lines += _wrap(f"{', '.join(names)}: {source}", "  ")
    return lines


def evidence_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The evidence of each backend and of each constraint, once for backends that share it."""
    shared: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for r in rows:
        constraints = tuple(f"constraint {c['kind']}: {c['detail']} [{c['evidence']}]"
                            for c in r["constraints"])
        shared.setdefault((r["view"], r["evidence"], constraints), []).append(r["name"])
    lines = ["EVIDENCE (whether each backend's kernels read a layer view's strides):"]
    for (view, evidence, constraints), names in shared.items():
        other_view = "" if view == "vllm" else f" ({view} view)"  # vLLM's: every seeded backend
        lines += _wrap(f"{', '.join(names)}{other_view}: {evidence}", "  ")
        for constraint in constraints:
            lines += _wrap(constraint, "    ")
    return lines


def _wrap(text: str, indent: str) -> list[str]:
    """`text` in lines of at most WIDTH columns, the first indented by `indent`, the rest by
    four more (paths are broken only where they exceed a line)."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    ",
                         break_on_hyphens=False)


def _cc_arg(text: str) -> tuple[int, int]:
    try:
        return registry.parse_compute_capability(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
