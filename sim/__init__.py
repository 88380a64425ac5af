"""splitserve's discrete-event simulator (`splitserve sim ...`).

Each simulated worker runs the engine's real scheduler, KV cache manager and block pool
(engine/) with a latency model in place of the forward pass; the gateway's real router
(gateway/routing/) and Locality (gateway/locality.py) route over an in-process block
index with the Redis index's interface. KV transfers and tier restores are timed by a
link model. Nothing here is imported by the serving path.
"""

from __future__ import annotations

import glob
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def source_of(so: str) -> str:
    """A build's source: sim/x.cpython-311-...so and sim/x__mypyc.cpython-311-...so
    (mypyc's, sim/native.py) -> sim/x.py"""
    name = os.path.basename(so).split(".", 1)[0].removesuffix("__mypyc")
    return os.path.join(os.path.dirname(so), f"{name}.py")


def _refuse_stale_builds(here: str = _HERE) -> None:
    """A compiled module shadows its .py: one older than its source would run old code."""
    for so in glob.glob(os.path.join(here, "*.so")):
        src = source_of(so)
        if os.path.exists(src) and os.path.getmtime(so) < os.path.getmtime(src):
            raise ImportError(f"{so} is older than {src}: run `make deps` to compile "
                              "it again, or delete it to run the source")


_refuse_stale_builds()
