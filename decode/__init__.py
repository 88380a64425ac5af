"""The decode side of disaggregation: a worker of role "decode" receives a prompt's KV
from the peers the gateway named instead of computing it.

`decode.remote.RemotePrefiller` runs the kvtransfer receiver over the worker's KV cache,
pulls prefix blocks from a peer holding them (`FetchKV`) and has a prefill worker push
the rest (`Prefill`), fenced by a generation per transfer. The role-agnostic server that
hosts it is worker/ (worker/service.py hands it a request through `WorkerService._run`).
"""
