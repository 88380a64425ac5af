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


# Modules `make` compiles with mypyc (Makefile): a compiled copy shadows the .py, so
# one older than its source would run old code. Checked here, before either loads.
COMPILED = ("block_pool",)


def _refuse_stale_builds(here: str = os.path.dirname(os.path.abspath(__file__))) -> None:
    for name in COMPILED:
        src = os.path.join(here, f"{name}.py")
        for so in glob.glob(os.path.join(here, f"{name}.*.so")):
            if os.path.exists(src) and os.path.getmtime(so) < os.path.getmtime(src):
                raise ImportError(f"{so} is older than {src}: run `make deps` to compile "
                                  "it again, or delete it to run the source")


_refuse_stale_builds()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
