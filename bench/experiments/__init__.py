"""Experiments (`splitserve bench experiment NAME`): each starts the configurations it
compares, in one run, and returns one `Report`. Registered by name in `EXPERIMENTS`
(module, help); a module exposes `run(ExperimentConfig) -> Report`."""

from __future__ import annotations

EXPERIMENTS: dict[str, tuple[str, str]] = {
    "disagg": ("bench.experiments.disagg",
               "colocated vs disaggregated on 2 cores: decode TPOT under long prefills"),
    "transports": ("bench.experiments.transports",
                   "ucx vs tcp vs shm for one disaggregated cluster: TTFT, KV hand-off"),
    "decider": ("bench.experiments.decider",
                "sweep of the local-vs-remote prefill threshold"),
    "routing": ("bench.experiments.routing",
                "routing profiles on shared-prefix and Mooncake-trace workloads"),
    "fairness": ("bench.experiments.fairness",
                 "tenants through the admission queue: FCFS vs VTC, a strategy changed live"),
    "faults": ("bench.experiments.faults",
               "per injected fault kind: success, clean errors, latency, leaked blocks"),
}
