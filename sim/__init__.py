"""splitserve's discrete-event simulator (`splitserve sim ...`).

Each simulated worker runs the engine's real scheduler, KV cache manager and block pool
(engine/) with a latency model in place of the forward pass; the gateway's real router
(gateway/routing/) and Locality (gateway/locality.py) route over an in-process block
index with the Redis index's interface. KV transfers and tier restores are timed by a
link model. Nothing here is imported by the serving path.
"""
