"""One simulated worker: the engine's real Scheduler, KVCacheManager and BlockPool (and
OffloadConnector, over simulated tiers), with the latency model in place of the model
runner. The LLMEngine calls it makes are the ones engine/llm_engine.py makes, in the
same order: schedule -> (restores) -> forward -> update_from_output -> stop checks ->
finish; allocate_remote / remote_kv_ready for disaggregated requests; pin / unpin of
cached blocks for peers.

Requests carry no token ids (sim/request.py).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any, cast

from engine.block_pool import BlockRemoved, BlockStored, KVBlock
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.offload import OffloadConnector
from engine.pins import Pins
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from sim.index import InProcessBlockIndex
from sim.latency import LatencyModel
from sim.profile import HardwareProfile
from sim.request import SimRequest
from sim.tiers import SimTiers

_INF = float("inf")
NO_KV: Any = None  # where the engine passes its KV cache tensor: there are no bytes here


@dataclass(slots=True)
class Step:
    """A step in progress: what the scheduler scheduled, from `start` to `end`.

    A decode window (`ends` set) stands for several decode iterations exactly:
    `ends[i]` is when iteration i + 1 ends, as the one-iteration steps would have timed
    it, and `done` of them stand (fewer once new work cut it). `window` holds the blocks
    the window's iterations take and fill (Window)."""

    out: SchedulerOutput
    start: float
    dt: float
    end: float
    ends: list[float] | None = None
    dts: list[float] | None = None
    done: int = 1
    window: Window | None = None


@dataclass(slots=True)
class Window:
    """The blocks a decode window takes, in the order the one-iteration steps would
    take them: `blocks[j]` (which held `hashes[j]`, evicted then) goes to `owners[j]` at
    the start of iteration `takes[j]` (sorted), at the time `starts[j]` (the end of the
    iteration before it; -inf for the first iteration's); `kept` of them stand (fewer
    once cut); the evictions of the first `evicted` are published.

    With offload tiers, the blocks its iterations fill: `save_blocks[j]` (holding
    `save_hashes[j]`) is full at the end of iteration `save_iters[j]` (sorted; within
    one, in the scheduler's row order), when the one-iteration steps would cache it and
    save it to the tiers; the first `saved` of them are saved."""

    takes: list[int]
    starts: list[float]
    blocks: list[KVBlock]
    hashes: list[Any]
    owners: list[str]
    kept: int
    evicted: int = 0
    save_iters: list[int] = field(default_factory=list)
    save_blocks: list[KVBlock] = field(default_factory=list)
    save_hashes: list[Any] = field(default_factory=list)
    saved: int = 0

    def evictions(self, first: int, last: int) -> list[Any]:
        """The cached hashes the window's iterations first..last evict."""
        lo, hi = bisect_left(self.takes, first), bisect_right(self.takes, last)
        return [h for h in self.hashes[lo:hi] if h is not None]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    role: str  # prefill | decode | colocated
    num_blocks: int
    host_blocks: int = 0  # offload tiers (0: none)
    disk_blocks: int = 0


class SimWorker:
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
        self.kv = KVCacheManager(spec.num_blocks, bs, enable_caching=True)
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
    def decode_window(self) -> tuple[int, list[tuple[int, int]]]:
        """How many decode iterations the next step can stand for exactly (1: just the
        next), and the blocks they take: (iteration, row) per block, in the order the
        one-iteration steps would take them. Every running request decodes and none
        waits to be admitted; for the next k iterations none of them ends and the free
        queue holds every block they take (nothing is preempted). New work, or anything
        else that touches this worker's pool, cuts the window at the iteration running
        then (`cut`), as it would wait for that iteration's end; until then nothing
        another worker or the gateway reads differs from the one-iteration steps (the
        evictions are published at their iterations' starts, sim/cluster.py; load
        reports count blocks as of now, `free_blocks_at`). With offload tiers, the blocks
        the iterations fill are saved at those iterations' ends (`save_window`)."""
        s = self.scheduler
        if not self.windows or not s.running \
                or any(r.status != RequestStatus.WAITING_FOR_REMOTE_KV for r in s.waiting):
            return 1, []
        bs = self.profile.block_size
        blocks = self.kv.req_blocks
        k = s.config.max_num_batched_tokens // len(s.running)
        for r in s.running:
            if r.num_tokens - r.num_computed_tokens != 1 or r.hold_kv:
                return 1, []
            k = min(k, cast(SimRequest, r).max_output - r.num_output_tokens,
                    self.max_model_len - r.num_tokens)
        if k <= 1:
            return 1, []
        # Iteration i computes token c + i - 1 of a request that has computed c: it
        # takes a block when that token starts one past the blocks the request holds.
        takes = []
        for row, r in enumerate(s.running):
            first = len(blocks[r.request_id]) * bs - r.num_computed_tokens + 1
            takes += [(i, row) for i in range(first, k + 1, bs)]
        free = self.kv.pool.num_free_blocks
        if len(takes) > free:
            takes.sort()
            k = takes[free][0] - 1  # the first iteration that would preempt: not in
            if k <= 1:
                return 1, []
            takes = takes[:bisect_right(takes, (k, len(s.running)))]
        elif len(takes) > 1:
            takes.sort()
        return k, takes

    def _start_window(self, k: int, takes: list[tuple[int, int]]) -> Step:
        s = self.scheduler
        pool = self.kv.pool
        self.publish_events()  # what came before: the window's own events go per iteration
        rows = list(s.running)
        computed = [r.num_computed_tokens for r in rows]
        held = [len(self.kv.req_blocks[r.request_id]) for r in rows]
        taken = pool.peek_free(len(takes))
        hashes = [b.block_hash for b in taken]
        for r in rows:
            cast(SimRequest, r).hand_ahead(k - 1)
        out = s.schedule()
        if out.preempted or len(out.scheduled) != len(rows) or any(
                x.num_new_tokens != k for x in out.scheduled):
            raise RuntimeError("decode window: the scheduler did not run every decoding "
                               f"request {k} tokens")
        # The scheduler took the blocks request by request; hand them out as the
        # one-iteration steps would (iteration by iteration), so the pool is theirs.
        mine: list[list[KVBlock]] = [[] for _ in rows]
        for (_, row), b in zip(takes, taken, strict=True):
            mine[row].append(b)
        for r, h, m in zip(rows, held, mine, strict=True):
            table = self.kv.req_blocks[r.request_id]
            if len(table) - h != len(m):
                raise RuntimeError("decode window: the scheduler took other blocks")
            table[h:] = m
        # the evictions: published per iteration instead (Window.evictions)
        if any(not isinstance(ev, BlockRemoved) for ev in pool.take_events()) or (
                self.offload is not None and self.offload.loads):
            raise RuntimeError("decode window: the scheduler did more than take blocks")
        dts = self.latency.decode_iterations(computed, k)
        if self.profile.token_overhead_s:
            dts = [d + self.profile.token_overhead_s * len(rows) for d in dts]
        start = self.clock()
        # the one-iteration steps' clock: each ends at the last end + dt (a sequential
        # running sum of floats, as those steps add)
        ends = list(accumulate(dts, initial=start))[1:]
        t = ends[-1]
        # iteration i > 1 starts at the end of i - 1
        window = Window([i for i, _ in takes],
                        [ends[i - 2] if i > 1 else -_INF for i, _ in takes], taken, hashes,
                        [rows[row].request_id for _, row in takes], len(takes),
                        bisect_right(takes, (1, len(rows))))
        if takes and takes[0][0] == 1:
            self.index.apply_device(self.worker_id, (), window.evictions(1, 1))
        if self.offload is not None:
            self._plan_saves(window, out, k)
        return Step(out, start, t - start, t, ends, dts, k, window)

    def _plan_saves(self, w: Window, out: SchedulerOutput, k: int) -> None:
        """The blocks the window's iterations fill (Window): a row that has computed c
        tokens fills a block at the end of iteration i when c + i is a multiple of the
        block size."""
        bs = self.profile.block_size
        fills = []
        for row, x in enumerate(out.scheduled):
            r = x.request
            c = r.num_computed_tokens
            table = self.kv.req_blocks[r.request_id]
            for i in range(bs - c % bs, k + 1, bs):
                n = (c + i) // bs - 1
                fills.append((i, row, table[n], r.block_hashes[n]))
        fills.sort(key=lambda f: (f[0], f[1]))
        w.save_iters = [f[0] for f in fills]
        w.save_blocks = [f[2] for f in fills]
        w.save_hashes = [f[3] for f in fills]

    def save_window(self, w: Window, last: int) -> None:
        """Saves to the tiers what the window's iterations up to `last` filled (those
        not saved yet), one batch per iteration, as each one-iteration step's end does
        (OffloadConnector.save_new of what update_from_output cached)."""
        iters, lo = w.save_iters, w.saved
        hi = bisect_right(iters, last, lo)
        while lo < hi:
            e = bisect_right(iters, iters[lo], lo, hi)
            self._save(w.save_blocks[lo:e], w.save_hashes[lo:e])
            lo = e
        w.saved = hi

    def _save(self, blocks: Sequence[KVBlock], hashes: Sequence[Any]) -> None:
        """OffloadConnector.save_new's hand-off of newly cached blocks to the tiers."""
        assert self.offload is not None
        if self.offload.offload.save(hashes, [b.block_id for b in blocks], NO_KV):
            # SimTiers' saves complete at once (sim/tiers.py): nothing to hold
            raise RuntimeError("decode window: a tier holds device blocks to copy")

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

    def cut(self, now: float) -> float | None:
        """New work at `now` for this busy worker: the step in progress ends with the
        iteration running now, as an engine picks new work up at its next iteration.
        Returns the step's new end, or None when it ends then anyway."""
        step = self.current
        assert step is not None
        if step.ends is None:  # one iteration: it ends when it ends
            return None
        # a decode window: exactly as the one-iteration steps it stands for
        done = min(bisect_left(step.ends, now) + 1, step.done)
        if done >= step.done:
            return None
        step.done = done
        step.end = step.ends[done - 1]
        if step.window is not None:
            self._untake(step.window, done)
        return step.end

    def _untake(self, w: Window, done: int) -> None:
        """Gives back the blocks of the window's iterations past `done`: nothing wrote
        them, so they return to the free queue's head with the hashes they held, as the
        one-iteration steps would never have taken them."""
        keep = bisect_right(w.takes, done)
        if keep >= w.kept:
            return
        tables = self.kv.req_blocks
        for j in range(w.kept - 1, keep - 1, -1):  # each owner's latest blocks first
            if tables[w.owners[j]].pop() is not w.blocks[j]:
                raise RuntimeError("decode window: a block table changed under the window")
        self.kv.pool.unget(w.blocks[keep:w.kept], w.hashes[keep:w.kept])
        w.kept = keep

    def free_blocks_at(self, now: float) -> int:
        """The pool's free blocks as the one-iteration steps have them at `now`: a
        decode window has taken its later iterations' blocks already."""
        free = self.kv.pool.num_free_blocks
        step = self.current
        if self.busy and step is not None and step.window is not None:
            # the takes of iterations started by `now` (iteration i runs from the end of
            # i - 1, exclusive, to its own, inclusive); a cut kept those up to `done`
            w = step.window
            free += max(0, w.kept - bisect_left(w.starts, now))
        return free

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
        if step.dts is not None:
            k, j = len(step.dts), step.done
            for x in out.scheduled:
                if j < k:  # cut: the tokens handed ahead past iteration j are not sampled
                    cast(SimRequest, x.request).hand_ahead(j - k)
                    x.num_new_tokens = j
            for d in step.dts[:j]:
                self.busy_s += d
            self.steps += j
            self.tokens_computed += len(out.scheduled) * j
        sampled = {s.request.request_id: (0, None) for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens
                   >= s.request.num_tokens}
        got = self.scheduler.update_from_output(out, sampled)
        if step.dts is not None and step.done > 1:
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

    def _save_window_end(self, w: Window, done: int) -> None:
        """The save at a window's last iteration's end. update_from_output cached every
        iteration's fills now; those of the earlier iterations went to the tiers at their
        ends (sim/cluster.py). The one-iteration step's batch is the rest, in the pool's
        order: what was cached while that iteration ran (a remote prefill's landed
        blocks, which cut the window), then the iteration's own fills."""
        earlier = bisect_left(w.save_iters, done)
        if w.saved != earlier:
            raise RuntimeError("decode window: an iteration's save was missed")
        new = self.kv.pool.take_new_cached()
        saved = set(w.save_hashes[:earlier])
        rest = [b for b in new if b.block_hash not in saved]
        last = w.save_hashes[earlier:bisect_right(w.save_iters, done)]
        tail = [b.block_hash for b in rest[len(rest) - len(last):]]
        if len(new) - len(rest) != earlier or tail != last:
            raise RuntimeError("decode window: it cached other blocks than planned")
        if rest:
            self._save(rest, [b.block_hash for b in rest])
        w.saved += len(last)

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
        """LLMEngine._check_stop for ignore_eos requests."""
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
