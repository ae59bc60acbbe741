"""`kvconnector bench`: block offload throughput, block-major vs vLLM's layer-major copies.

Modules: presets (model shapes), sizing (budgets, ids), ceilings (same-run baselines), movers (what
copies blocks), runner (one case), remote (the remote tier), report (table, JSON, plot), cli.
"""

from kvconnector.bench.cli import add_parser, run

__all__ = ["add_parser", "run"]
