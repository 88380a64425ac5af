"""The gateway in a process of its own: the simulated cluster on both of a machine's
cores, with the same results.

A run's work splits where the serving system splits: the gateway (the block index, the
registry's load reports, Locality and the Router: sim/gateway.py) and the workers (their
engines, the event clock, everything else: sim/cluster.py). At 512 workers and 16-token
blocks the gateway's part is ~40 % of a run (measured: routes 27 %, index writes 8 %,
load reports, trust and in-flight counts 4 %), so the two sides, each on a core, could
take ~60 % of one process's time; two simulations side by side on this 2-core box do
not slow each other (3 %).

What it buys depends on how the requests arrive (`sim bench --workers 512`, 30,000
requests at 16-token blocks, one process then two): the Mooncake trace's timestamps
are coarse (12,031 requests at 1,180 distinct instants), so it arrives in clumps of ~10
at once (90 % of the gaps are 0); the gateway must route a clump one request after the
other while the workers have only the RPC's lookahead of work. Over pipes a short run
was no faster (24.5 vs 24.6 s), the million 1.25x (800.2 vs 1,002.6 s the same hour):
late in a long run the workers' side slows (every prompt evicts, from memory no cache
holds) and the gateway's does not. Each message batch's write and each wake of the
other process cost a system call and, on this virtual machine, an interrupt across
cores, on both sides (~6 % of each process's time); through shared memory, with a
waiting reader polling first (sim/channel.py), 30,000 requests take 16.5 s against 20.8 s
in one process (1.26x; pipes 19.0 s the same hour), and the million 607.1 s against
649.0 s over pipes the same morning (560.9-588.1 s with a few cuts in the route since).

They meet where the serving system's parts meet, by messages, in the workers' event
order. The workers' process (the one that called `Simulator.run`) runs the event clock;
what an event tells the gateway (a pool's stores and evictions for the index, a
worker's load figures, a request's start and end, its first response) goes to the
gateway's process as it happens, with its simulated time, and the gateway applies it in
that order; an arrival goes with the prompt's block hashes, and the gateway routes it
with the index, loads and in-flight counts every earlier event left, as one process
would. The route comes back as a decision, and the workers' process needs it only when
the request reaches its decode worker, the request's RPC later (`request_overhead_s /
2`, 11 ms for the H100 profile: ~3 arrivals at 512 workers): that is the lookahead.
Until then the workers' process goes on with its events while the gateway routes.

So both processes compute what one would: the same routes from the same state, the
same event order (tests/unit/sim/test_split.py holds a run in two processes to the same
requests, worker figures, transfers, index and trust as in one). Two things move: a
request the gateway turns away (429, or no candidate) gets its result at its RPC's time
instead of its arrival's (the same result), and block hashes keep their values but not
their identities across the processes (the index keeps segments, not hashes).

The workers' figures a load report reads (free blocks, waiting and running requests,
the blocks a decode window took ahead) are mirrored (`WorkerMirror`): a worker an event
touched (`Simulator._kick`, `_sync`) sends them before the next arrival, and a worker
whose request starts or ends (`changed`) sends them first, as the gateway reads them
then.
"""

from __future__ import annotations

import os
import traceback
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, Scores
from gateway.routing.profile import NoCandidates, RoutingProfile
from sim.channel import Channel, fork_channel
from sim.collector import long_lived_heap
from sim.gateway import SimGateway
from sim.index import Deferred, InProcessBlockIndex
from sim.request import Tokens
from sim.segments import Runs, runs_of

# the workers' messages: (kind, simulated time, ...)
DEVICE, CHANGED, WINDOW, UNWINDOW, ARRIVE, INFLIGHT, OBSERVE, PRODUCER, TIERS, DEFER, \
    SETTLE, END = range(12)

# -- the workers' side -------------------------------------------------------------------

class RemoteIndex(InProcessBlockIndex):
    """The workers' view of the index: what they publish goes to the gateway's."""

    def __init__(self, channel: Channel, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.now = clock
        self.channel = channel
        self._ids: dict[Deferred, int] = {}
        self._count = 0
        self.final_entries = 0  # the gateway's index at the end of the run

    def apply_device(self, node: str, stored: Any = (), removed: Any = ()) -> None:
        stored = stored if isinstance(stored, (list, tuple)) else list(stored)
        removed = removed if isinstance(removed, (list, tuple)) else list(removed)
        if stored or removed:
            self.channel.send((DEVICE, self.now(), node, runs_of(stored) if stored else [],
                               runs_of(removed, ordered=False) if removed else []))

    def apply(self, node: str, stored: Sequence[tuple[int, str]] = (),
              removed: Sequence[tuple[int, str]] = ()) -> None:
        self.channel.send((TIERS, self.now(), node, list(stored), list(removed)))

    def defer(self, node: str, hashes: list[int], due: list[float]) -> Deferred:
        d = Deferred(node, [], [])
        self._count += 1
        self._ids[d] = self._count
        self.channel.send((DEFER, self.now(), node, hashes, due, self._count))
        return d

    def settle(self, d: Deferred, until: float) -> None:
        self.channel.send((SETTLE, self.now(), self._ids.pop(d), until))

    def num_entries(self) -> int:
        return self.final_entries


class RemoteGateway(SimGateway):
    """The workers' view of the gateway in its own process (`start`): the calls
    sim/cluster.py makes on a SimGateway become messages; routes come back as decisions,
    in arrival order."""

    def __init__(self, channel: Channel, workers: dict[str, Any], clock: Callable[[], float],
                 pid: int) -> None:  # no SimGateway state: that lives over there
        self.channel = channel
        self.clock = clock
        self.pid = pid
        self.workers = workers
        self.row = {wid: i for i, wid in enumerate(workers)}
        self._windowed: set[Any] = set()  # workers whose window_started was sent
        self.dirty: set[Any] = set()  # workers an event touched since their last figures
        self._by_row = [Candidate(w.worker_id, w.worker_id, w.role) for w in workers.values()]
        self._waiting: deque[Any] = deque()  # flights sent, their decisions not read
        self.rejected: dict[int, str] = {}  # flight index -> why the gateway refused it
        self.accuracy: list[tuple[str, Any]] = []  # the gateway's trust at the end
        # seconds each process waited for the other: the workers for decisions, the
        # gateway for messages (read at the end)
        self.waits = {"workers": 0.0, "gateway": 0.0}

    def load(self, w: Any, out: list[int]) -> list[int]:
        """Appends `w`'s figures a load report reads: its row, free blocks, waiting and
        running requests, the blocks its decode window took ahead (0: none)."""
        step = w.current
        kept = step.window.kept if w.busy and step is not None and step.window is not None \
            else 0
        out += (self.row[w.worker_id], w.kv.pool.num_free_blocks, len(w.scheduler.waiting),
                len(w.scheduler.running), kept)
        return out

    def arrive(self, flight: Any) -> None:
        """Sends the request (routed over there) with the touched workers' figures."""
        loads: list[int] = []
        for w in self.dirty:
            self.load(w, loads)
        self.dirty.clear()
        route = flight.route
        self.channel.send((ARRIVE, self.clock(), loads, route.request_id,
                           len(route.prompt_token_ids), runs_of(route.block_hashes)))
        self.channel.flush()
        self._waiting.append(flight)

    def decide(self, flight: Any) -> str | None:
        """Sets `flight.decision` (reading decisions up to its own), or returns why the
        gateway refused it."""
        self.channel.flush()
        while flight.decision is None and flight.index not in self.rejected:
            msg = self._recv()
            f = self._waiting.popleft()
            if len(msg) == 2:
                self.rejected[f.index] = msg[1]
                continue
            _, d, p, k, blocks = msg
            c = self._by_row
            f.decision = RouteDecision(c[d], c[p] if p >= 0 else None, Scores(),
                                       c[k] if k >= 0 else None, blocks)
        return self.rejected.pop(flight.index, None)

    def window_started(self, worker: Any) -> None:
        self._windowed.add(worker)
        self.channel.send((WINDOW, self.clock(), self.load(worker, []),
                           list(worker.current.window.starts)))

    def window_ended(self, worker: Any) -> None:
        if worker in self._windowed:
            self._windowed.discard(worker)
            self.channel.send((UNWINDOW, self.clock(), self.row[worker.worker_id]))

    def changed(self, worker: Any) -> None:
        self.dirty.discard(worker)
        self.channel.send((CHANGED, self.clock(), self.load(worker, [])))

    def add_inflight(self, worker_id: str, delta: int) -> None:
        self.channel.send((INFLIGHT, self.clock(), self.row[worker_id], delta))

    def producers(self, delta: int) -> None:
        """A remote prefill's producer request joined or left the simulator's flights
        (the gateway's in-flight limit counts them)."""
        self.channel.send((PRODUCER, self.clock(), delta))

    def observe(self, decision: RouteDecision, req: RouteRequest, actual: int) -> None:
        self.channel.send((OBSERVE, self.clock(), req.request_id, actual))

    def finish(self, index: RemoteIndex) -> None:
        """The run is over: the gateway's final figures, and its process's end."""
        waited = self.channel.waited  # for decisions (not for the final figures)
        self.channel.send((END, self.clock()))
        self.channel.flush()
        _, index.final_entries, self.accuracy, gateway_waited = self._recv()
        self.waits = {"workers": waited, "gateway": gateway_waited}
        self._end()

    def _recv(self) -> Any:
        msg = self.channel.recv()
        if msg[0] == "error":
            self._end()
            raise RuntimeError(f"the gateway's process failed:\n{msg[1]}")
        return msg

    def _end(self) -> None:
        self.channel.close()
        os.waitpid(self.pid, 0)

    # what a SimGateway does that the workers' process must not
    def route(self, req: RouteRequest) -> Any:
        raise RuntimeError("routes are the gateway process's")

    def candidates(self) -> Any:
        raise RuntimeError("candidates are the gateway process's")


# -- the gateway's side ------------------------------------------------------------------

class _Sized:
    """A count `len` reads (a scheduler's queue, as a load report counts it)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __len__(self) -> int:
        return self.n


class WorkerMirror:
    """A worker as the gateway's process knows it, from its figures (duck-types what
    SimGateway reads of a SimWorker: its pool's size and free blocks, its scheduler's
    queues, a decode window's blocks ahead)."""

    def __init__(self, worker_id: str, role: str, num_blocks: int) -> None:
        self.worker_id = worker_id
        self.role = role
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.waiting = _Sized()
        self.running = _Sized()
        self.kept = 0  # blocks its decode window took ahead, 0 when none runs
        self.starts: list[float] = []  # that window's iterations' starts
        self.kv = self.pool = self.scheduler = self

    def blocks_ahead(self, now: float) -> int:
        if not self.kept:
            return 0
        return max(0, self.kept - bisect_left(self.starts, now))


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve(channel: Channel, routing: RoutingProfile, workers: list[tuple[str, str, int]],
          report_interval_s: float, in_flight_limit: int, block_size: int) -> None:
    """The gateway's process: applies the workers' messages in order and routes each
    arrival as sim/cluster.py's `_arrive` would."""
    clock = _Clock()
    index = InProcessBlockIndex(clock)
    mirrors = [WorkerMirror(*w) for w in workers]
    gw = SimGateway(routing, index, {m.worker_id: m for m in mirrors},  # type: ignore[misc]
                    clock, report_interval_s)
    row = {m.worker_id: i for i, m in enumerate(mirrors)}
    flights = 0  # the simulator's flights (requests and remote prefills) in progress
    predicted: dict[str, tuple[str, int]] = {}  # request -> (decode, predicted cached)
    deferred: dict[int, Deferred] = {}
    send = channel.send
    def mirror(loads: list[int]) -> WorkerMirror:
        """Sets the workers' figures `RemoteGateway.load` sent; returns the last one."""
        m = mirrors[0]
        for i in range(0, len(loads), 5):
            m = mirrors[loads[i]]
            m.num_free_blocks, m.waiting.n, m.running.n, m.kept = loads[i + 1:i + 5]
        return m

    msg = channel.recv()
    channel.waited = 0.0  # from the run's first message (not while the workers are built)
    while True:
        kind = msg[0]
        clock.now = msg[1]
        if kind == DEVICE:
            index.apply_device_runs(msg[2], msg[3], msg[4])
        elif kind == CHANGED:
            gw.changed(mirror(msg[2]))  # type: ignore[arg-type]
        elif kind == WINDOW:
            m = mirror(msg[2])
            m.starts = msg[3]
            gw.window_started(m)  # type: ignore[arg-type]
        elif kind == UNWINDOW:
            gw.window_ended(mirrors[msg[2]])  # type: ignore[arg-type]
        elif kind == ARRIVE:
            mirror(msg[2])
            rid = msg[3]
            route = RouteRequest(rid, Tokens(msg[4]), Runs(msg[5]),  # type: ignore[arg-type]
                                 block_size)
            d = None
            if 0 <= in_flight_limit <= flights:
                reply: tuple[Any, ...] = (rid, "overloaded: the gateway is at its in-flight limit")
            else:
                try:
                    filled, d = gw.route(route)
                except NoCandidates as e:
                    reply = (rid, f"no worker available: {e}")
                else:
                    reply = (rid, row[d.decode.worker_id],
                             row[d.prefill.worker_id] if d.prefill is not None else -1,
                             row[d.kv_peer.worker_id] if d.kv_peer is not None else -1,
                             d.kv_peer_blocks)
            send(reply)
            channel.flush()  # before the bookkeeping: the workers may be waiting on it
            if d is not None:
                flights += 1
                gw.add_inflight(d.decode.worker_id, 1)
                predicted[rid] = (d.decode.worker_id, d.predicted_cached(filled))
        elif kind == INFLIGHT:  # a request's flight ended on the worker (started: here)
            gw.add_inflight(mirrors[msg[2]].worker_id, msg[3])
            flights += msg[3]
        elif kind == OBSERVE:
            decode, guess = predicted.pop(msg[2])
            gw.locality.observe(decode, guess, msg[3])
        elif kind == PRODUCER:
            flights += msg[2]
        elif kind == DEFER:
            deferred[msg[5]] = index.defer(msg[2], msg[3], msg[4])
        elif kind == SETTLE:
            index.settle(deferred.pop(msg[2]), msg[3])
        elif kind == TIERS:
            index.apply(msg[2], msg[3], msg[4])
        elif kind == END:
            send(("end", index.num_entries(), sorted(gw.locality._accuracy.items()),
                  channel.waited))
            channel.flush()
            return
        else:
            raise RuntimeError(f"unknown message {kind}")
        msg = channel.recv()


def start_gateway(routing: RoutingProfile, workers: list[tuple[str, str, int]],
          report_interval_s: float, in_flight_limit: int, block_size: int
          ) -> tuple[Channel, int]:
    """Forks the gateway's process (before the workers are built: it holds none of
    their memory); returns the workers' end of the channel and the process id."""
    ch, pid = fork_channel()
    if pid == 0:  # the gateway's process
        code = 0
        try:
            try:
                with long_lived_heap():  # as the workers' run (sim/collector.py)
                    serve(ch, routing, workers, report_interval_s, in_flight_limit,
                          block_size)
            except EOFError:
                code = 1
            except BaseException:
                ch.send(("error", traceback.format_exc()))
                ch.flush()
                code = 1
        finally:
            os._exit(code)
    return ch, pid
