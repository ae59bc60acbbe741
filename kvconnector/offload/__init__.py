"""The offload cores, free of vLLM: what the connector's two halves do, driven by plain data.

- scheduler: `OffloadScheduler` (lookups, which blocks to load and store each step, pins), with
  its lookup and load half in loads.py and what it tracks in records.py;
- worker: `OffloadWorker` (the engine's cache, the host pool, the copy engine, the remote fetches);
- jobs: the per-step jobs and reports passed between them;
- remote_tier: the remote store as the scheduler and the worker use it (lookups, fetch, put).

The vLLM adapter (`kvconnector.vllm`) translates vLLM's calls into these and nothing more.
"""
