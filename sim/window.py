"""A step in progress, and the exact decode windows: one scheduler step that stands for
several decode iterations of a worker whose requests all decode, exactly as the
one-iteration steps it replaces (the same blocks taken in the same order, evictions
published and tier saves made at their iterations' starts and ends on the simulated
clock, load reports as of now). New work, or anything that touches the worker's pool,
cuts a window at the iteration running then, which gives the later iterations' blocks
back. SimWorker (sim/worker.py) runs the steps. The evictions are the index's deferred
removals (InProcessBlockIndex.defer: a read applies those due by its time; the window's
end or cut settles the rest); the simulator (sim/cluster.py) schedules a window's tier
saves one event at a time (`next_window_event`, `window_due`).

A window is an optimization only: `ClusterConfig.decode_windows=False` steps one
iteration at a time, and tests/unit/sim/test_simulator.py holds the two to the same
results, worker figures, index and tier contents.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from engine.block_pool import BlockRemoved, KVBlock
from engine.kv_cache_manager import KVCacheManager
from engine.offload import OffloadConnector
from engine.request import RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from sim.index import Deferred, InProcessBlockIndex
from sim.latency import LatencyModel, WindowClock
from sim.pool import SimBlockPool
from sim.profile import HardwareProfile

INF: Final = float("inf")
NO_KV: Any = None  # where the engine passes its KV cache tensor: there are no bytes here


@dataclass(slots=True)
class Step:
    """A step in progress: what the scheduler scheduled, from `start` to `end`.

    A decode window (`clock` set) stands for `k` decode iterations exactly, timed as
    the one-iteration steps would have timed them (WindowClock), and `done` of them
    stand (fewer once new work cut it); `since`: when the last of those started;
    `busy`: the worker's busy time once they are done. `window` holds the blocks the
    window's iterations take and fill (Window)."""

    out: SchedulerOutput
    start: float
    dt: float
    end: float
    clock: WindowClock | None = None
    k: int = 1
    done: int = 1
    window: Window | None = None
    since: float = -INF
    busy: float = 0.0
    _ends: list[float] | None = None

    def iteration_ends(self) -> list[float]:
        """When each of a decode window's iterations ends (made once, when first asked:
        by tier saves and inter-token latencies, which few windows need)."""
        assert self.clock is not None
        if self._ends is None:
            self._ends = self.clock.ends(self.k)
        return self._ends


@dataclass(slots=True)
class Window:
    """The blocks a decode window takes, in the order the one-iteration steps would
    take them: `blocks[j]` (which held `hashes[j]`, evicted then) goes to `owners[j]` at
    the start of iteration `takes[j]` (sorted), at the time `starts[j]` (the end of the
    iteration before it; -inf for the first iteration's); `kept` of them stand (fewer
    once cut). The evictions of the first iteration's are published at the window's
    start, the later ones are the index's `deferred` removals at their times.

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
    deferred: Deferred | None = None
    save_iters: list[int] = field(default_factory=list)
    save_blocks: list[KVBlock] = field(default_factory=list)
    save_hashes: list[Any] = field(default_factory=list)
    saved: int = 0


class DecodeWindows:
    """SimWorker's decode windows (what they use of the worker is declared here)."""

    kv: KVCacheManager
    pool: SimBlockPool  # kv's
    scheduler: Scheduler
    offload: OffloadConnector | None
    index: InProcessBlockIndex
    latency: LatencyModel
    profile: HardwareProfile
    worker_id: str
    max_model_len: int
    windows: bool
    busy: bool
    busy_s: float
    current: Step | None
    clock: Callable[[], float]

    def publish_events(self) -> None:  # SimWorker's
        raise NotImplementedError

    def decode_window(self) -> tuple[int, list[tuple[int, int]]]:
        """How many decode iterations the next step can stand for exactly (1: just the
        next), and the blocks they take: (iteration, row) per block, in the order the
        one-iteration steps would take them. Every running request decodes and none
        waits to be admitted; for the next k iterations none of them ends and the free
        queue holds every block they take (nothing is preempted). New work, or anything
        else that touches this worker's pool, cuts the window at the iteration running
        then (`cut`), as it would wait for that iteration's end; until then nothing
        another worker or the gateway reads differs from the one-iteration steps (the
        evictions are published at their iterations' starts, `window_due`; load
        reports count blocks as of now, `blocks_ahead`). With offload tiers, the blocks
        the iterations fill are saved at those iterations' ends (`save_window`)."""
        s = self.scheduler
        if not self.windows or not s.running \
                or any(r.status != RequestStatus.WAITING_FOR_REMOTE_KV for r in s.waiting):
            return 1, []
        bs = self.profile.block_size
        blocks = self.kv.req_blocks
        running: list[Any] = s.running  # SimRequests
        k = s.config.max_num_batched_tokens // len(running)
        most = self.max_model_len
        firsts = []
        for r in running:
            n = r.num_tokens
            c = r.num_computed_tokens
            if n - c != 1 or r.hold_kv:
                return 1, []
            left = r.max_output - r.num_output_tokens
            if left < k:
                k = left
            if most - n < k:
                k = most - n
            # Iteration i computes token c + i - 1 of a request that has computed c: it
            # takes a block when that token starts one past the blocks the request holds.
            firsts.append(len(blocks[r.request_id]) * bs - c + 1)
        if k <= 1:
            return 1, []
        takes = []
        for row, first in enumerate(firsts):
            if first <= k:
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
        pool = self.pool
        self.publish_events()  # what came before: the window's own events go per iteration
        rows: list[Any] = list(s.running)  # SimRequests
        computed = [r.num_computed_tokens for r in rows]
        held = [len(self.kv.req_blocks[r.request_id]) for r in rows]
        taken = pool.peek_free(len(takes))
        hashes: list[Any] = [b.block_hash for b in taken]  # ints (sim/workload.py)
        for r in rows:
            r.hand_ahead(k - 1)
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
            self.kv.set_blocks(r.request_id, table[:h] + m)
        # the evictions: each at its iteration's start instead (below)
        if any(not isinstance(ev, BlockRemoved) for ev in pool.take_events()) or (
                self.offload is not None and self.offload.loads):
            raise RuntimeError("decode window: the scheduler did more than take blocks")
        start = self.clock()
        # the one-iteration steps' clock: each ends at the last end + dt (a sequential
        # running sum of floats, as those steps add)
        clock = self.latency.window_clock(computed, start,
                                          self.profile.token_overhead_s * len(rows))
        first = bisect_right(takes, (1, len(rows)))  # the first iteration's takes
        # iteration i > 1 starts at the end of i - 1
        _, t, since, busy, starts = clock.walk(k, self.busy_s, INF,
                                               [i - 1 for i, _ in takes[first:]])
        window = Window([i for i, _ in takes], [-INF] * first + starts, taken, hashes,
                        [rows[row].request_id for _, row in takes], len(takes))
        if first:
            self.index.apply_device(self.worker_id, (),
                                    [h for h in hashes[:first] if h is not None])
        # the later iterations' evictions: the index applies each at its time
        later = [j for j in range(first, len(takes)) if hashes[j] is not None]
        if later:
            gone = [hashes[j] for j in later]  # ints
            window.deferred = self.index.defer(self.worker_id, gone,
                                               [window.starts[j] for j in later])
        if self.offload is not None:
            self._plan_saves(window, out, k)
        return Step(out, start, t - start, t, clock, k, k, window, since, busy)

    def _plan_saves(self, w: Window, out: SchedulerOutput, k: int) -> None:
        """The blocks the window's iterations fill (Window): a row that has computed c
        tokens fills a block at the end of iteration i when c + i is a multiple of the
        block size."""
        bs = self.profile.block_size
        fills = []
        for row, x in enumerate(out.scheduled):
            r: Any = x.request  # a SimRequest: its block hashes are ints
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

    def cut(self, now: float) -> float | None:
        """New work at `now` for this busy worker: the step in progress ends with the
        iteration running now, as an engine picks new work up at its next iteration.
        Returns the step's new end, or None when it ends then anyway."""
        step = self.current
        assert step is not None
        if step.clock is None:  # one iteration: it ends when it ends
            return None
        # a decode window: exactly as the one-iteration steps it stands for
        done, end, since, busy, _ = step.clock.walk(step.done, self.busy_s, now)
        shorter = done < step.done
        if shorter:
            step.done, step.end, step.since, step.busy = done, end, since, busy
        # before anything touches the pool: the evictions of the iterations that stand
        # (all started by now) in the index, those of the others never
        self.settle_evictions(step)
        if not shorter:
            return None
        if step.window is not None:
            self._untake(step.window, done)
        return step.end

    def settle_evictions(self, step: Step) -> None:
        """The window's deferred evictions (InProcessBlockIndex.defer): those of its
        standing iterations take effect now (the ones not applied yet), the rest never."""
        w = step.window
        if w is not None and w.deferred is not None:
            self.index.settle(w.deferred, step.since)
            w.deferred = None

    def _untake(self, w: Window, done: int) -> None:
        """Gives back the blocks of the window's iterations past `done`: nothing wrote
        them, so they return to the free queue's head with the hashes they held, as the
        one-iteration steps would never have taken them."""
        keep = bisect_right(w.takes, done)
        if keep >= w.kept:
            return
        tables = self.kv.req_blocks
        for j in range(w.kept - 1, keep - 1, -1):  # each owner's latest blocks first
            table = tables[w.owners[j]]
            if table[-1] is not w.blocks[j]:
                raise RuntimeError("decode window: a block table changed under the window")
            self.kv.set_blocks(w.owners[j], table[:-1])
        self.pool.unget(w.blocks[keep:w.kept], w.hashes[keep:w.kept])
        w.kept = keep

    def blocks_ahead(self, now: float) -> int:
        """The blocks a decode window in progress took for iterations not started by
        `now` (iteration i runs from the end of i - 1, exclusive, to its own, inclusive;
        a cut kept those up to `done`): free in the pool as the one-iteration steps have
        it at `now`. Once 0 it stays 0 for the window (a later cut keeps every iteration
        started by then)."""
        step = self.current
        if self.busy and step is not None and step.window is not None:
            w = step.window
            return max(0, w.kept - bisect_left(w.starts, now))
        return 0

    def _save_window_end(self, w: Window, done: int) -> None:
        """The save at a window's last iteration's end. update_from_output cached every
        iteration's fills now; those of the earlier iterations went to the tiers at their
        ends (`window_due`). The one-iteration step's batch is the rest, in the pool's
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

    # -- a window's saves (events on the simulated clock, sim/cluster.py) ---------------
    def next_window_event(self, step: Step) -> float:
        """When the window's next save is due (INF: none before its end): with tiers,
        the blocks an iteration fills are saved at its end (the last iteration's with
        the step's end). The simulator schedules one at a time, so that a cut window
        leaves at most one behind. (Its evictions need no event: the index applies
        them at their times, `InProcessBlockIndex.defer`.)"""
        win = step.window
        assert win is not None
        s = win.saved
        if s < len(win.save_iters) and win.save_iters[s] < step.done:
            return step.iteration_ends()[win.save_iters[s] - 1]
        return INF

    def window_due(self, step: Step, now: float) -> None:
        """What the window's iterations have filled by `now`, saved: as the
        one-iteration steps do at an iteration's end."""
        win = step.window
        assert win is not None
        done, ends = step.done, step.iteration_ends()
        iters, s = win.save_iters, win.saved
        while s < len(iters) and iters[s] < done and ends[iters[s] - 1] <= now:
            s += 1
        if s > win.saved:
            self.save_window(win, iters[s - 1])
