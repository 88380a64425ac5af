"""splitserve's inference engine (paged KV cache, continuous batching, sampling).

Importing this package is cheap: heavy modules (torch) load on first use of
`LLM`, `AsyncLLM` or `SamplingParams`, so torch-free users such as the gateway can
import `engine.block_hash` and `engine.config`.
"""

from __future__ import annotations

import glob
import os
from typing import Any

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput"]

_LAZY = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
}


def source_of(so: str) -> str:
    """A compiled module's source: x.cpython-311-...so, and mypyc's x__mypyc.*.so, are
    built from x.py in the same folder."""
    name = os.path.basename(so).split(".", 1)[0].removesuffix("__mypyc")
    return os.path.join(os.path.dirname(so), f"{name}.py")


def refuse_stale_builds(here: str = os.path.dirname(os.path.abspath(__file__))) -> None:
    """`make` compiles modules with mypyc (the engine's block pool, the simulator's hot
    modules: Makefile); a compiled copy shadows the .py, so one older than its source
    would run old code. Checked by the package before any of them loads (a C extension
    with no .py of its name, e.g. sim/_arenas.c's, is not checked)."""
    for so in glob.glob(os.path.join(here, "*.so")):
        src = source_of(so)
        if os.path.exists(src) and os.path.getmtime(so) < os.path.getmtime(src):
            raise ImportError(f"{so} is older than {src}: run `make deps` to compile "
                              "it again, or delete it to run the source")


refuse_stale_builds()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
