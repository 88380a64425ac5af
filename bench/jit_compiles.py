"""The Triton kernel variants a run compiles, seen through Triton's compile hook
(`triton.knobs.runtime.jit_cache_hook`): `bench engine` records those compiled inside a
timed run, by step, since a variant first met there costs that step its compile."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def jit_compiles(step_index: Callable[[], int]) -> Iterator[list[dict[str, Any]]]:
    """The Triton kernels compiled while inside, as {"step": step_index(), "kernel":
    name, "constants": its constexprs}: a kernel variant first met inside a timed run
    costs that step its compile (a disk-cache hit, milliseconds; a cold compile, up
    to seconds). Empty where Triton has no compile hook (or runs interpreted)."""
    found: list[dict[str, Any]] = []
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield found
        return

    def hook(**kw: Any) -> bool:
        fn, spec = kw.get("fn"), kw.get("compile") or {}
        # Triton keys the constants by argument path ((index,) for a plain argument)
        names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
        constants = {}
        for k, v in (spec.get("constants") or {}).items():
            if isinstance(k, tuple) and len(k) == 1 and 0 <= k[0] < len(names):
                k = names[k[0]]
            constants[str(k)] = str(v)
        found.append({"step": step_index(), "kernel": getattr(fn, "name", str(fn)),
                      "constants": constants})
        return bool(previous(**kw)) if previous else False

    runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        runtime.jit_cache_hook = previous
