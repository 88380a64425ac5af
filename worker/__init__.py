"""The worker process, whatever its role (prefill, decode, colocated): a gRPC
`splitserve.v1.Worker` over one engine, plus its model load, KV-transfer endpoint,
offload tiers, block-index publisher, registration, load reports, metrics and fault
hooks.

`worker.server.serve(WorkerConfig, EngineConfig)` runs it; `splitserve worker` is the
command line (worker/cli.py). The prefill and decode roles add the hand-off connector
(worker/handoff.py): a prefill worker serves `Prefill` with it, a decode worker's engine
fills parked requests through it.
"""
