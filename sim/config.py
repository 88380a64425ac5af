"""What a simulated cluster is made of (`splitserve sim run`'s options): the worker
pools, their KV capacity and tiers, the gateway's routing and limits, and the exactness
switch (decode windows)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.profile import RoutingProfile


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    prefill: int = 0
    decode: int = 0
    colocated: int = 2
    num_blocks: int = 0  # per worker; 0: the profile's
    host_blocks: int = 0
    disk_blocks: int = 0
    routing: RoutingProfile = field(default_factory=RoutingProfile)
    report_interval_s: float = 0.1  # worker/config.py load_interval_ms
    # The gateway's limit (429 beyond): 0 its default (gateway.config.in_flight_limit:
    # grows with the decode/colocated workers), -1 none.
    max_in_flight: int = 0
    max_model_len: int = 131072  # llama 3.1's context: the Mooncake trace's prompts fit
    salt: int = 0  # bench's per-phase cache_salt: a fresh chain of block hashes
    itl_every: int = 1  # keep ITL gaps of every n-th request (memory on long runs)
    seed: int = 0  # the pickers' randomness when the routing profile sets none
    # Exact either way: a worker whose requests all decode runs the iterations until
    # one of them ends as one scheduler step (sim/window.py decode_window), cut short
    # by new work. False: one scheduler step per iteration
    # (the reference the tests hold the windows against).
    decode_windows: bool = True

    def __post_init__(self) -> None:
        if self.prefill and not self.decode:
            raise ValueError("prefill workers need decode workers")
        if self.decode + self.colocated < 1:
            raise ValueError("need at least one decode or colocated worker")
        if min(self.prefill, self.decode, self.colocated, self.num_blocks, self.host_blocks,
               self.disk_blocks) < 0 or self.itl_every < 1 or self.report_interval_s < 0 \
                or self.max_in_flight < -1:
            raise ValueError("counts must be >= 0, itl_every >= 1, report interval >= 0, "
                             "max_in_flight >= -1")

    @property
    def in_flight_limit(self) -> int:
        """The gateway's limit on requests in flight; -1: none."""
        from gateway.config import in_flight_limit

        if self.max_in_flight < 0:
            return -1
        return in_flight_limit(self.max_in_flight, self.decode + self.colocated)

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated
