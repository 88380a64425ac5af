"""The simulated cluster: a gateway (the real Router and Locality over the in-process
index) in front of simulated workers, on one event clock.

A request's path is the serving path's (gateway/core.py, worker/service.py,
worker/handoff.py):

    arrive -> gateway: block hashes, index lookup (Locality), Router.route
      -> decode D (after the request RPC). Peers named?  D.allocate_remote (local hit +
         tier restores), pull the run a kv_peer holds (FetchKV: pin, push, unpin),
         then the prefill peer P runs it as a producer (hold_kv, one token), pushing each
         finished chunk's blocks to D; when the last landed, D.remote_kv_ready(first
         token) and P releases its blocks. Otherwise D prefills locally.
      -> D's continuous batching streams the rest.

Time: each worker steps when it has work; a step lasts what the latency model says. A
worker whose requests all decode runs the iterations up to the first that ends one of
them as one scheduler step, each timed as its own (an exact decode window, sim/window.py):
the blocks its iterations take are evicted in the index at those iterations' starts,
with offload tiers the blocks they fill are saved at their ends, and anything that
touches the worker first cuts the window at the iteration running then (`_sync`), which
gives back the blocks later iterations took. Transfers take a worker's egress link
(sim/worker.py). The gateway's part (routing, the registry's view, in-flight counts) is
sim/gateway.py.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final, cast

from bench.base import RequestResult
from engine.kv_cache_manager import cdiv
from engine.request import RequestStatus
from gateway.routing.base import RouteDecision, RouteRequest
from gateway.routing.profile import NoCandidates
from sim.collector import long_lived_heap
from sim.config import ClusterConfig
from sim.gateway import SimGateway
from sim.index import InProcessBlockIndex
from sim.latency import LatencyModel
from sim.profile import HardwareProfile
from sim.request import SimRequest, Tokens, make_request
from sim.window import Step
from sim.worker import SimWorker, WorkerSpec
from sim.workload import BlockHasher, SimRequestSpec

_INF: Final = float("inf")


@dataclass(slots=True)
class Flight:
    """One request from arrival to its last token."""

    index: int
    spec: SimRequestSpec
    req: SimRequest
    route: RouteRequest
    decision: RouteDecision | None = None
    first: float | None = None
    last: float = 0.0
    itl: list[float] | None = None
    kv_landed: float = 0.0  # remote prefill: when the last pushed block lands on D
    sent_blocks: int = 0
    computed: int = 0  # remote prefill: prompt tokens D held before the push (hit + pull)
    delivered: int = 0  # output tokens the client has


@dataclass(slots=True)
class SimStats:
    transfer_bytes: dict[str, int] = field(default_factory=dict)  # prefill, peer, host, disk
    remote_prefills: int = 0
    peer_fetches: int = 0
    peer_misses: int = 0
    rejected: int = 0
    stalled: int = 0
    invalid: int = 0  # refused by the worker (too long for its context or KV pool)
    events: int = 0
    windows: int = 0  # decode windows run (several decode iterations as one step)

    def add_bytes(self, kind: str, n: int) -> None:
        self.transfer_bytes[kind] = self.transfer_bytes.get(kind, 0) + n


class Simulator:
    def __init__(self, config: ClusterConfig, profile: HardwareProfile,
                 latency: LatencyModel | None = None) -> None:
        self.config = config
        self.profile = profile
        self.latency = latency or LatencyModel(profile)
        self.hasher = BlockHasher(profile.block_size)
        nb = config.num_blocks or profile.num_blocks
        specs = [WorkerSpec(f"prefill-{i}", "prefill", nb, config.host_blocks,
                            config.disk_blocks) for i in range(config.prefill)]
        specs += [WorkerSpec(f"decode-{i}", "decode", nb, config.host_blocks,
                             config.disk_blocks) for i in range(config.decode)]
        specs += [WorkerSpec(f"colocated-{i}", "colocated", nb, config.host_blocks,
                             config.disk_blocks) for i in range(config.colocated)]
        routing = config.routing
        if routing.seed is None:
            routing = replace(routing, seed=config.seed)
        self.index = InProcessBlockIndex(self.clock)
        with long_lived_heap():
            self.workers = {s.worker_id: SimWorker(s, profile, self.latency, self.index,
                                                   config.max_model_len, self.clock,
                                                   config.decode_windows)
                            for s in specs}
        self.gateway = SimGateway(routing, self.index, self.workers, self.clock,
                                  config.report_interval_s)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self._flights: dict[str, Flight] = {}
        self.results: list[RequestResult | None] = []
        self.stats = SimStats()
        self._arrivals: Iterator[SimRequestSpec] = iter(())
        self._rpc = profile.request_overhead_s / 2  # each way
        self._in_flight_limit = config.in_flight_limit

    # -- the clock ----------------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def run(self, specs: Iterable[SimRequestSpec]) -> list[RequestResult]:
        """Replays `specs` (in arrival order) to the end; returns one result per request,
        in arrival order."""
        self._arrivals = iter(specs)
        self._next_arrival()
        heap = self._heap
        pop = heapq.heappop
        n = 0
        with long_lived_heap():
            while heap:
                t, _, fn, arg = pop(heap)
                self.now = t
                fn(arg)
                n += 1
        self.stats.events += n
        self._fail_stalled()
        for w in self.workers.values():
            for tier, n in w.restored_bytes.items():
                self.stats.add_bytes(tier, n)
        return [r for r in self.results if r is not None]

    def _fail_stalled(self) -> None:
        """Requests left when no event is: the workers' schedulers hold them and will
        never run them (e.g. head-of-line behind a request that needs blocks parked
        requests hold). They fail with that reason, and their blocks are freed."""
        for rid, flight in list(self._flights.items()):
            if rid.startswith("prefill-") or self.results[flight.index] is not None:
                continue
            self.stats.stalled += 1
            d = flight.decision
            assert d is not None
            w = self.workers[d.decode.worker_id]
            w.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            if d.prefill is not None:
                p = self.workers[d.prefill.worker_id]
                p.scheduler.finish(f"prefill-{rid}", RequestStatus.FINISHED_ABORTED)
            self._reject(flight, "stalled: the worker's scheduler never ran it")
        self._flights.clear()

    def _next_arrival(self) -> None:
        spec = next(self._arrivals, None)
        if spec is not None:
            self.at(spec.arrival_s, self._arrive, spec)

    # -- the gateway (sim/gateway.py) -------------------------------------------------
    def _arrive(self, spec: SimRequestSpec) -> None:
        self._next_arrival()
        i = len(self.results)
        self.results.append(None)
        rid = f"r{i}"
        n_total = spec.prompt_len + spec.output_len
        hashes = self.hasher.hashes(spec, n_total, self.config.salt)
        req = make_request(rid, spec.prompt_len, hashes, self.now, max_output=spec.output_len)
        bs = self.profile.block_size
        route = RouteRequest(rid, Tokens(spec.prompt_len),  # type: ignore[arg-type]
                             cast(list[bytes], hashes[:spec.prompt_len // bs]), bs)
        flight = Flight(i, spec, req, route)
        if 0 <= self._in_flight_limit <= len(self._flights):
            self._reject(flight, "overloaded: the gateway is at its in-flight limit")
            return
        try:
            flight.route, decision = self.gateway.route(route)
        except NoCandidates as e:
            self._reject(flight, f"no worker available: {e}")
            return
        flight.decision = decision
        self._flights[rid] = flight
        self.gateway.add_inflight(decision.decode.worker_id, 1)
        self.at(self.now + self._rpc, self._on_decode, flight)

    def _reject(self, flight: Flight, error: str) -> None:
        if not error.startswith(("stalled", "invalid")):
            self.stats.rejected += 1
        s = flight.spec
        self.results[flight.index] = RequestResult(
            ok=False, prompt_len=s.prompt_len, start_s=s.arrival_s, error=error, tag=s.tag)

    # -- the decode worker's Generate (worker/service.py, worker/handoff.py) --------------
    def _on_decode(self, flight: Flight) -> None:
        d = flight.decision
        assert d is not None
        w = self.workers[d.decode.worker_id]
        req = flight.req
        self.gateway.changed(w)  # its Generate started: its next load report follows
        error = w.validate(flight.spec.prompt_len, flight.spec.output_len)
        if error is not None:  # the worker's INVALID_ARGUMENT: the client gets a 400
            del self._flights[req.request_id]
            self.gateway.add_inflight(w.worker_id, -1)
            self.stats.invalid += 1
            self._reject(flight, f"invalid: {error}")
            return
        self._sync(w)
        if w.role == "decode" and (d.prefill is not None or d.kv_peer is not None) \
                and w.scheduler.allocate_remote(req):
            t = self.now + w.restore_seconds()
            bs = self.profile.block_size
            computed = req.num_computed_tokens
            if d.kv_peer is not None:
                t, computed = self._pull(flight, w, t, computed)
            if d.prefill is not None:
                flight.sent_blocks = computed // bs
                flight.computed = computed
                self.at(t + self._rpc, self._on_prefill, flight)
            else:
                cap = (flight.spec.prompt_len - 1) // bs * bs
                self.at(t, self._remote_ready, (flight, None, min(computed, cap)))
            return
        w.scheduler.add_request(req)
        self._kick(w)

    def _pull(self, flight: Flight, w: SimWorker, t: float, computed: int) -> tuple[float, int]:
        """FetchKV from the kv peer: the blocks it holds past ours, or nothing (a miss)."""
        d = flight.decision
        assert d is not None and d.kv_peer is not None
        bs = self.profile.block_size
        n_prompt = flight.spec.prompt_len
        first = computed // bs
        # The prompt's full blocks when a prefill peer sends the rest, else all but the
        # block of the last prompt token (its logits are computed here).
        limit = n_prompt // bs if d.prefill is not None else (n_prompt - 1) // bs
        end = min(d.kv_peer_blocks, limit)
        if end <= first:
            return t, computed
        peer = self.workers[d.kv_peer.worker_id]
        self._sync(peer)
        blocks = peer.pin(flight.req.block_hashes[first:end])
        peer.publish_events()
        if len(blocks) < end - first:
            peer.unpin(blocks)
            self.stats.peer_misses += 1
            return t, computed
        nbytes = (end - first) * self.latency.kv_block_bytes
        landed = peer.link(t + self._rpc, nbytes)
        self.at(landed, self._unpin, (peer, blocks))
        self.stats.add_bytes("peer", nbytes)
        self.stats.peer_fetches += 1
        return landed, end * bs

    def _unpin(self, arg: tuple[SimWorker, list[Any]]) -> None:
        """The pulled blocks have landed: the peer lets its pins go."""
        peer, blocks = arg
        self._sync(peer)
        peer.unpin(blocks)

    def _on_prefill(self, flight: Flight) -> None:
        """The prefill peer's Prefill: the prompt as a producer (worker/handoff.py)."""
        d = flight.decision
        assert d is not None and d.prefill is not None
        p = self.workers[d.prefill.worker_id]
        spec = flight.spec
        hashes = flight.req.block_hashes[:(spec.prompt_len + 1) // self.profile.block_size]
        prod = make_request(f"prefill-{flight.req.request_id}", spec.prompt_len, hashes,
                            self.now, hold_kv=True)
        self._flights[prod.request_id] = flight
        p.scheduler.add_request(prod)
        self.stats.remote_prefills += 1
        self._kick(p)

    def _push(self, flight: Flight, p: SimWorker, done: int) -> None:
        """Sends the producer's newly finished blocks to the decode."""
        if done > flight.sent_blocks:
            nbytes = (done - flight.sent_blocks) * self.latency.kv_block_bytes
            flight.kv_landed = p.link(self.now, nbytes)
            self.stats.add_bytes("prefill", nbytes)
            flight.sent_blocks = done

    def _remote_ready(self, arg: tuple[Flight, int | None, int | None]) -> None:
        flight, first_token, computed = arg
        d = flight.decision
        assert d is not None
        w = self.workers[d.decode.worker_id]
        req = flight.req
        self._sync(w)  # the landed blocks are cached now: a window gives back first
        w.scheduler.remote_kv_ready(req, first_token, computed)
        if first_token is not None:
            self._token(w, flight)
        self._kick(w)

    # -- steps --------------------------------------------------------------------------
    def _kick(self, w: SimWorker) -> None:
        if w.busy:  # the new work waits for the iteration running now
            self._sync(w)
            return
        step = w.start_step()
        w.publish_events()
        if step is None:
            return
        w.busy = True
        w.current = step
        w.version += 1
        self.at(step.end, self._step_done, (w, step, w.version))
        if step.window is not None:
            self.stats.windows += 1
            if step.window.kept:  # it took blocks ahead: the load reports must see
                self.gateway.window_started(w)
            self._window_events(w, step)

    def _sync(self, w: SimWorker) -> None:
        """Before anything touches a busy worker's scheduler or pool: its step ends with
        the iteration running now (a decode window gives back what later ones took)."""
        if w.busy:
            end = w.cut(self.now)
            if end is not None:
                w.version += 1
                self.at(end, self._step_done, (w, w.current, w.version))

    def _window_events(self, w: SimWorker, step: Step) -> None:
        """Schedules a decode window's next publication (sim/window.py)."""
        t = w.next_window_event(step)
        if t < _INF:
            self.at(t, self._window_due, (w, step))

    def _window_due(self, arg: tuple[SimWorker, Step]) -> None:
        w, step = arg
        if w.current is not step or step.window is None or step.clock is None:
            return  # a later step's
        w.window_due(step, self.now)
        self._window_events(w, step)

    def _step_done(self, arg: tuple[SimWorker, Step, int]) -> None:
        w, step, version = arg
        if version != w.version:
            return  # the step was cut short; its new end is another event
        w.busy = False
        self.gateway.window_ended(w)
        got = w.finish_step(step)
        out = step.out
        ends = None  # a window's tokens' times, for the requests that keep theirs
        bs = self.profile.block_size
        for req in got:
            if req.hold_kv:
                self._producer_done(w, req)
            else:
                flight = self._flights[req.request_id]
                if ends is None and step.clock is not None and flight.itl is not None:
                    ends = step.iteration_ends()[:step.done]
                self._token(w, flight, ends)
        for s in out.scheduled:  # producers' finished chunks go out while the next computes
            r = s.request
            if r.hold_kv and r.status == RequestStatus.RUNNING:
                self._push(self._flights[r.request_id], w, r.num_computed_tokens // bs)
        w.publish_events()
        self._kick(w)

    def _producer_done(self, p: SimWorker, prod: Any) -> None:
        flight = self._flights.pop(prod.request_id)
        p.scheduler.finish(prod.request_id, RequestStatus.FINISHED_LENGTH)
        self._push(flight, p, cdiv(flight.spec.prompt_len, self.profile.block_size))
        landed = max(self.now, flight.kv_landed)
        self.at(landed, self._release, (p, prod.request_id))
        self.at(landed + self._rpc, self._remote_ready, (flight, 0, flight.computed))

    def _release(self, arg: tuple[SimWorker, str]) -> None:
        """The producer's KV has landed on the decode: it frees its held blocks."""
        p, request_id = arg
        self._sync(p)
        p.scheduler.release(request_id)
        p.publish_events()
        self._kick(p)

    def _token(self, w: SimWorker, flight: Flight, ends: list[float] | None = None) -> None:
        """A token reached the client (time of the step's end, plus the way back); a
        decode window's tokens, one at each of its iterations' `ends`."""
        t = self.now
        if flight.first is None:
            flight.first = t
            if flight.spec.output_len > 1 and flight.index % self.config.itl_every == 0:
                flight.itl = []
            assert flight.decision is not None
            self.gateway.observe(flight.decision, flight.route, flight.req.num_cached_tokens or 0)
        elif flight.itl is not None:
            n = flight.req.num_output_tokens - flight.delivered  # > 1 after a window
            if ends is not None and len(ends) == n:
                last = flight.last
                for e in ends:
                    flight.itl.append(e - last)
                    last = e
            else:
                flight.itl.extend([(t - flight.last) / n] * n)
        flight.last = t
        flight.delivered = flight.req.num_output_tokens
        req = flight.req
        if w.stop_reason(req, flight.spec.output_len) is not None:
            self.gateway.changed(w)  # its Generate ends: its next load report follows
            w.scheduler.finish(req.request_id, RequestStatus.FINISHED_LENGTH)
            w.requests_done += 1
            self._complete(w, flight)

    def _complete(self, w: SimWorker, flight: Flight) -> None:
        del self._flights[flight.req.request_id]
        self.gateway.add_inflight(w.worker_id, -1)
        s = flight.spec
        assert flight.first is not None
        lat = self.profile.request_overhead_s / 2  # the response's way back
        self.results[flight.index] = RequestResult(
            ok=True, prompt_len=s.prompt_len, output_len=flight.req.num_output_tokens,
            start_s=s.arrival_s, ttft_s=flight.first - s.arrival_s + lat,
            e2e_s=flight.last - s.arrival_s + lat, itl_s=flight.itl or [],
            cached_tokens=flight.req.num_cached_tokens or 0, tag=s.tag)

    # -- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every pool's invariants hold, and nothing is still in flight."""
        for w in self.workers.values():
            w.check_integrity()
        assert not self._flights, f"{len(self._flights)} requests still in flight"
