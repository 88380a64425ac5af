"""splitserve's inference engine (paged KV cache, continuous batching, sampling).

Importing this package is cheap: heavy modules (torch) load on first use of
`LLM`, `AsyncLLM` or `SamplingParams`, so torch-free users such as the gateway can
import `engine.block_hash` and `engine.config`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput"]

_LAZY = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
