"""The decode / colocated worker: a gRPC `splitserve.v1.Worker` over one engine.

`decode.server.serve(WorkerConfig, EngineConfig)` runs it; `splitserve worker` is the
command line. The remote-prefill branch lives behind `WorkerService._run`
(decode/service.py).
"""
