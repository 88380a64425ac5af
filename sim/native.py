"""The simulator's own hot modules compiled with mypyc: the same source without the
interpreter, as the engine's block pool is. `make` removes the old builds and runs
`python -m sim.native MODULE...` (the Makefile's SIM_NATIVE_MODULES); where it cannot
build (no C compiler), the source runs.

A compiled module shadows its .py, so one older than its source would run old code:
sim/__init__.py refuses that before anything loads (engine.refuse_stale_builds).

What it bought (sim bench, 60,000 requests on 512 workers at 16-token blocks, this
2-core machine, one after the other): 1,336 -> 1,415-1,479 simulated req/s; the
million there 948.2 -> 926.2 s (late in a run it waits on memory), at 512-token blocks
476.9 -> 385.7 s (sessions apart). What it costs: ~20 s of `make deps`. mypy reads
what the modules import for its types, except the heavy third-party packages the
simulator never calls (torch alone took three minutes).
A class other code wraps on the instance (sim/accounting.py) is declared
`mypyc_attr(native_class=False)`; a value whose engine type the simulator bends (a
SimRequest's token counters and int hashes, sim/request.py) is read as Any.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile

from engine import source_of

HERE = os.path.dirname(os.path.abspath(__file__))
_SKIPPED = ("torch", "transformers", "triton", "safetensors", "tokenizers", "xgrammar",
            "lmcache", "ucxx", "grpc", "aiohttp", "redis", "matplotlib", "jinja2")


def compiled_modules(here: str = HERE) -> list[str]:
    """The modules with a compiled build here (sim/_arenas.c's has no .py: not one)."""
    return sorted({os.path.basename(source_of(so))[:-3]
                   for so in glob.glob(os.path.join(here, "*.so"))
                   if os.path.exists(source_of(so))})


def build(modules: list[str]) -> None:
    """Compiles sim/MODULE.py for each of `modules` in place (from the repository root)."""
    from mypyc.build import mypycify
    from setuptools import setup

    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "mypy.ini")
        with open(config, "w") as f:
            f.write("[mypy]\nignore_missing_imports = True\n"
                    f"[mypy-{','.join(f'{m}.*' for m in _SKIPPED)}]\nfollow_imports = skip\n")
        # a fresh cache: mypyc's incremental builds have crashed on a changed class
        options = [f"--config-file={config}", f"--cache-dir={os.path.join(tmp, 'cache')}"]
        setup(name="splitserve-sim-native",
              script_args=["build_ext", "--inplace", "-j", str(os.cpu_count() or 1)],
              ext_modules=mypycify(options + [os.path.join("sim", f"{m}.py") for m in modules],
                                   opt_level="3", debug_level="0", separate=True))
    # the build copies a cached extension with the cache's time: make it newer than its
    # source, which it was built from
    for so in glob.glob(os.path.join(HERE, "*.so")):
        if os.path.basename(source_of(so))[:-3] in modules:
            os.utime(so)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m sim.native MODULE... (sim/MODULE.py; see the Makefile)")
    build(sys.argv[1:])
