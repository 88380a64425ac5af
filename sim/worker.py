"""One simulated worker: the engine's real Scheduler, KVCacheManager and BlockPool (and
OffloadConnector, over simulated tiers), with the latency model in place of the model
runner. The LLMEngine calls it makes are the ones engine/llm_engine.py makes, in the
same order: schedule -> (restores) -> forward -> update_from_output -> stop checks ->
finish; allocate_remote / remote_kv_ready for disaggregated requests; pin / unpin of
cached blocks for peers. A step may be an exact decode window, several decode
iterations as one scheduler step (sim/window.py, DecodeWindows).

Requests carry no token ids (sim/request.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, cast

from engine.block_pool import BlockRemoved, BlockStored, KVBlock
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.offload import OffloadConnector
from engine.pins import Pins
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from sim.index import InProcessBlockIndex
from sim.latency import LatencyModel
from sim.pool import SimBlockPool
from sim.profile import HardwareProfile
from sim.request import SimRequest
from sim.tiers import SimTiers
from sim.window import NO_KV, DecodeWindows, Step


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    role: str  # prefill | decode | colocated
    num_blocks: int
    host_blocks: int = 0  # offload tiers (0: none)
    disk_blocks: int = 0


class SimWorker(DecodeWindows):
    def __init__(self, spec: WorkerSpec, profile: HardwareProfile, latency: LatencyModel,
                 index: InProcessBlockIndex, max_model_len: int,
                 clock: Callable[[], float], windows: bool = True) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.role = spec.role
        self.profile = profile
        self.latency = latency
        self.index = index
        self.max_model_len = max_model_len
        bs = profile.block_size
        # the engine's manager over the simulator's pool (sim/pool.py: a decode window's
        # steps on it)
        self.pool = SimBlockPool(spec.num_blocks)
        self.kv = KVCacheManager(spec.num_blocks, bs, enable_caching=True, pool=self.pool)
        self.tiers: SimTiers | None = None
        offload = None
        caps = [("host", spec.host_blocks), ("disk", spec.disk_blocks)]
        if any(c for _, c in caps):
            self.tiers = SimTiers(caps, self._publish)
            offload = OffloadConnector(self.tiers, bs)
            self.kv.pool.track_new_cached = True
        self.offload = offload
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens), self.kv, offload,
            clock=clock)
        self.windows = windows  # exact decode windows (decode_window)
        self.clock = clock
        self.busy = False
        # the step in progress, and a version that tells its end event apart from a
        # superseded one
        self.current: Step | None = None
        self.version = 0
        self.link_free_at = 0.0  # this worker's egress link is busy until then
        self.pins = Pins(self.kv.pool)
        # per-worker load figures for the report
        self.busy_s = 0.0
        self.steps = 0
        self.tokens_computed = 0
        self.requests_done = 0
        self.restored_bytes: dict[str, int] = {}  # tier -> bytes restored into the device

    # -- the index --------------------------------------------------------------------
    def _publish(self, stored: list[tuple[Any, str]], removed: list[tuple[Any, str]]) -> None:
        self.index.apply(self.worker_id, stored, removed)

    def publish_events(self) -> None:
        """The block pool's stores and evictions since the last call, as the worker's KV
        event publisher sends them (tier "device")."""
        step = self.current
        if self.busy and step is not None and step.window is not None \
                and step.window.deferred is not None:
            # its stores would go in before evictions due earlier (Simulator._sync first)
            raise RuntimeError("decode window: the pool changed with its evictions unsettled")
        events = self.kv.pool.take_events()
        if not events:
            return
        stored: Sequence[Any]
        removed: Sequence[Any]
        if len(events) == 1:
            ev = events[0]
            stored = ev.block_hashes if isinstance(ev, BlockStored) else ()
            removed = ev.block_hashes if isinstance(ev, BlockRemoved) else ()
        else:
            # chain: the events' hashes joined at C level, in order
            stored = list(chain.from_iterable(ev.block_hashes for ev in events
                                              if isinstance(ev, BlockStored)))
            removed = list(chain.from_iterable(ev.block_hashes for ev in events
                                               if isinstance(ev, BlockRemoved)))
        # the simulator's hashes are ints (sim/workload.py), BlockHash's type aside
        self.index.apply_device(self.worker_id, cast(Sequence[int], stored),
                                cast(Sequence[int], removed))

    # -- a step -------------------------------------------------------------------------
    def start_step(self) -> Step | None:
        """Schedules one step (or an exact decode window); None when idle."""
        if self.offload is not None:
            self.offload.save_new(self.kv.pool, NO_KV)
        k, takes = self.decode_window()
        if k > 1:
            return self._start_window(k, takes)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return None
        dt = self.latency.step(out.scheduled) + self.restore_seconds()
        if self.profile.token_overhead_s:
            dt += self.profile.token_overhead_s * sum(
                1 for s in out.scheduled
                if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens)
        self.steps += 1
        self.busy_s += dt
        self.tokens_computed += out.num_tokens
        now = self.clock()
        return Step(out, now, dt, now + dt)

    def restore_seconds(self) -> float:
        """Runs the planned tier restores (the engine's _run_loads) and times them."""
        if self.offload is None or self.tiers is None:
            return 0.0
        self.offload.run_loads(NO_KV)
        block = self.latency.kv_block_bytes
        seconds = 0.0
        for tier, n in self.tiers.take_pending():
            seconds += self.profile.links[tier].seconds(n * block)
            self.restored_bytes[tier] = self.restored_bytes.get(tier, 0) + n * block
        return seconds

    def finish_step(self, step: Step) -> list[Request]:
        """Applies the step (one sampled token per request that reached its end; a
        decode window: `done` tokens per request, as that many steps would); returns
        the requests that got a token."""
        out = step.out
        if step.clock is not None:
            self.settle_evictions(step)
            k, j = step.k, step.done
            for x in out.scheduled:
                if j < k:  # cut: the tokens handed ahead past iteration j are not sampled
                    cast(SimRequest, x.request).hand_ahead(j - k)
                    x.num_new_tokens = j
            self.busy_s = step.busy
            self.steps += j
            self.tokens_computed += len(out.scheduled) * j
        sampled = {s.request.request_id: (0, None) for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens
                   >= s.request.num_tokens}
        got = self.scheduler.update_from_output(out, sampled)
        if step.clock is not None and step.done > 1:
            # What the window's other iterations charged (fair sharing). VTC orders by
            # the float counters: charged one token at a time, as those steps would.
            fair, extra = self.scheduler.fair, step.done - 1
            for r in got:
                if self.scheduler.config.policy == "vtc":
                    for _ in range(extra):
                        fair.charge_output(r)
                else:
                    fair.charge_output(r, extra)
        if self.offload is not None:
            if step.window is not None:
                self._save_window_end(step.window, step.done)
            self.offload.save_new(self.kv.pool, NO_KV)
            self.offload.reap(self.kv.pool)
        return got

    def validate(self, prompt_len: int, max_tokens: int) -> str | None:
        """LLMEngine.validate's length checks: why this engine would answer 400, or None."""
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            return (f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the request asks for {total}")
        need = -(-total // self.profile.block_size)
        if need > self.kv.pool.num_blocks:
            return f"the request needs {need} KV blocks; this engine has {self.kv.pool.num_blocks}"
        return None

    def stop_reason(self, req: Request, max_tokens: int) -> RequestStatus | None:
        """The output processor's stop checks (OutputProcessor.take_tokens) for
        ignore_eos requests: only the length ends them."""
        if req.num_output_tokens >= max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- peer fetch (holder side): engine/pins.py, as LLMEngine.pin_cached / unpin -------
    def pin(self, hashes: list[Any]) -> list[KVBlock]:
        return self.pins.pin(hashes, self.tiers)

    def unpin(self, blocks: list[KVBlock]) -> None:
        self.pins.unpin(blocks)

    def link(self, start: float, nbytes: int, kind: str = "kv") -> float:
        """Sends `nbytes` on this worker's egress link no earlier than `start`; returns
        when they have landed (transfers from one worker are serialized)."""
        begin = max(start, self.link_free_at)
        self.link_free_at = begin + self.profile.links[kind].seconds(nbytes)
        return self.link_free_at

    def check_integrity(self) -> None:
        self.kv.check_integrity(dict(self.pins.counts))
        if self.tiers is not None:
            self.tiers.check_integrity()
