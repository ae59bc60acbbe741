"""`kvconnector backends`: the attention-backend registry (kvconnector.layout.registry) as a
table or as JSON, with the layouts each backend accepts on this machine and the evidence for each
entry."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvconnector.layout import registry
from kvconnector.layout.registry import show_layouts


def backend_rows(compute_capability: tuple[int, int] | None = None, use_vllm: bool = True
                 ) -> list[dict[str, Any]]:
    """One JSON-ready dict per registered backend (what `kvconnector backends` prints)."""
    rows = []
    for entry in registry.registered_backends():
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
    table = [("NAME", "VIEW", "LAYOUTS", "BLOCK-OUTERMOST", "READS STRIDES", "CONSTRAINTS",
              "EVIDENCE")] + [(
                  r["name"], r["view"], show_layouts(r["layouts"]) + "".join(
                      f" [cc {m}: {show_layouts(lay)}]" for m, lay in r["layouts_by_cc"].items()),
                  show_layouts(r["block_outermost"]) if r["block_outermost"] else "-",
                  "yes" if r["reads_strides"] else "no",
                  ",".join(c["kind"] for c in r["constraints"]) or "-", r["evidence"],
              ) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  "
              + row[-1])
    recorded = [r for r in rows if not r["layouts_live"]]
    print(f"\nLAYOUTS: read from the installed vLLM for {len(rows) - len(recorded)} of "
          f"{len(rows)} backends; recorded for:")
    for r in recorded:
        print(f"  {r['name']}: {r['layouts_source']}")
    return 0


def _cc_arg(text: str) -> tuple[int, int]:
    try:
        return registry.parse_compute_capability(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
