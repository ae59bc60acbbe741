"""The offload cores, free of vLLM: what the connector's two halves do, driven by plain data.

- scheduler: `OffloadScheduler` (lookups, which blocks to load and store each step, pins), with
  its lookup and load half in loads.py and what it tracks in records.py;
- worker: `OffloadWorker` (the engine's cache, the host pool, the copy engine, the tiers' ops),
  with a checked pool's checksums in pool_checks.py and checked_loads.py;
- jobs: the per-step jobs and reports passed between them.

The tiers below the pool reach the cores only through the contract in transfer/tier.py (their
planners and workers, made by the adapter from transfer/registry.py): the cores name no tier.
The vLLM adapter (`kvconnector.vllm`) translates vLLM's calls into these and nothing more.
"""
