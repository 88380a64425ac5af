"""The worker process, whatever its role (prefill, decode, colocated): a gRPC
`splitserve.v1.Worker` over one engine, plus its model load, KV-transfer endpoint,
offload tiers, block-index publisher, registration, load reports, metrics and fault
hooks.

`worker.server.serve(WorkerConfig, EngineConfig)` runs it; `splitserve worker` is the
command line (worker/cli.py). The roles add one service each: prefill/ (`Prefill`, the
producer side of the hand-off) and decode/ (`RemotePrefiller`, the consumer side).
"""
