"""The `splitserve` command line: one entry point, subcommands loaded lazily.

Environment variables are read here and only here; everything below
receives plain config objects. Each subcommand lives in the package that owns it and
exposes `add_arguments(parser)` and `run(args) -> int`; importing a subcommand is
deferred so `splitserve --help` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from cluster.errors import ClusterError, fail

# name -> (module, help). Modules expose add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.cli", "generate text offline with the engine"),
    "worker": ("worker.cli", "run a prefill, decode or colocated worker (gRPC)"),
    "gateway": ("gateway.cli", "run the gateway (OpenAI HTTP + gRPC Generate)"),
    "up": ("cluster.up", "start redis, workers and the gateway locally"),
}

# `splitserve bench NAME`: benchmarks, each in its own module.
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("bench.engine_bench", "engine throughput vs transformers generate"),
    "host": ("bench.host_bench", "the engine's host time per decode step by phase (batch 256)"),
    "profile": ("bench.profile_bench", "torch.profiler over workload c's steps and one KV "
                "hand-off: host vs device time, launches, gaps, round trips"),
    "transfer": ("bench.transfer_bench", "KV transfer GB/s per transport vs memcpy / raw TCP"),
    "layout": ("bench.layout_bench", "a TP rank's KV head slice: token- vs head-major blocks"),
    "run": ("bench.run_cli", "measure a running OpenAI-compatible or splitserve gRPC server"),
    "experiment": ("bench.experiment_cli", "start and compare cluster configurations"),
    "routing": ("bench.routing_bench", "round-robin vs least-loaded vs cache-aware routing"),
    "tiers": ("bench.tiers_bench", "KV restore GB/s per offload tier vs recompute"),
    "index": ("bench.index_bench", "block-index lookup: server-side (Lua) vs Python walk"),
    "soak": ("bench.soak", "mixed load against `splitserve up`: no 5xx, no leak, flat RSS"),
    "chaos": ("bench.chaos", "processes killed and frozen under load: nothing wrong, hung "
              "or leaked"),
}


# `splitserve sim NAME`: the discrete-event simulator (sim/).
SIMS: dict[str, tuple[str, str]] = {
    "run": ("sim.run_cli", "one workload on a simulated cluster (bench run's report)"),
    "calibrate": ("sim.calibrate", "fit a hardware profile: the CPU engine here, or bench engine --device cuda runs"),
    "links": ("sim.links", "measure a profile's links: tier restores here, kv from bench transfer"),
    "bench": ("sim.speed", "the simulator's own speed (simulated requests/s)"),
    "experiment": ("sim.experiments", "routing, pd-ratio, tiers at cluster scale"),
}


def _add_lazy(sub: argparse._SubParsersAction, table: dict[str, tuple[str, str]],
              argv: Sequence[str]) -> None:
    for name, (module, help_text) in table.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        p.add_argument("--debug", action="store_true",
                       help="show the traceback of an error (also SPLITSERVE_DEBUG=1)")
        # Only import the module whose arguments are needed to parse this argv.
        if name in argv:
            importlib.import_module(module).add_arguments(p)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_lazy(sub, COMMANDS, argv)
    bench = sub.add_parser("bench", help="benchmarks (our figure next to its reference)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _add_lazy(bench_sub, BENCHES, argv)
    sim = sub.add_parser("sim", help="the discrete-event simulator (real router and scheduler)")
    sim_sub = sim.add_subparsers(dest="sim", required=True)
    _add_lazy(sim_sub, SIMS, argv)
    return parser


# What a subcommand raises for input it cannot use: config validation (ValueError,
# engine.config.ModelDirError among them), missing files and refused connections
# (OSError), a cluster that could not start (ClusterError).
USER_ERRORS = (ValueError, OSError, ClusterError)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_list).parse_args(args_list)
    debug = getattr(args, "debug", False) or os.environ.get("SPLITSERVE_DEBUG") == "1"
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except SystemExit as e:  # raise SystemExit("message"): the same one line
        if debug or not isinstance(e.code, str):
            raise
        return fail(e.code)
    except USER_ERRORS as e:
        if debug:
            raise
        return fail(str(e) or type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())
