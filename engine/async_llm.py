"""Async streaming front of the engine, for services: add a request and iterate its
outputs, abort it, read load stats.

The engine loop runs in one background thread (torch releases the GIL in its kernels,
so the asyncio loop stays responsive); commands cross into it through a queue and
outputs come back through `call_soon_threadsafe` into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import torch

from engine.block_pool import KVEvent
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RemoteAlloc, RequestError
from engine.offload import KVOffload
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerStats

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can run."""


@dataclass(frozen=True, slots=True)
class RemoteResult:
    """How a remote fill ended: `first_token` when the whole prompt's KV landed (and
    the remote sampler drew the token); else the KV is valid up to
    `num_computed_tokens` (block aligned; None: the local hit) and the rest is computed
    here."""

    first_token: int | None = None
    num_computed_tokens: int | None = None
    # n / best_of: every sample's first token (the first is `first_token`) and logprobs;
    # and the prompt's logprobs when asked for (LLMEngine.finish_remote).
    samples: tuple[tuple[int, dict[int, float] | None], ...] = ()
    prompt_logprobs: list[dict[int, float]] | None = None


class KVHandoff(Protocol):
    """The engine's hand-off connector (the decode side of disaggregation,
    worker/handoff.py): fills a parked request's blocks from elsewhere (a prefill node,
    a peer's cache). The scheduler decides which blocks those are (`RemoteAlloc`) and
    makes the request runnable from the result."""

    async def fill(self, alloc: RemoteAlloc, params: Any) -> RemoteResult:
        """Runs in the request's event loop; `params` are the request's (`generate`'s
        `kv_params`). Raising ends the request with an error (the `fail` policy)."""
        ...


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int
    remote: bool = False
    hold_kv: bool = False
    resume: list[int] = field(default_factory=list)
    tenant: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    client_id: str = ""


@dataclass(slots=True)
class _Abort:
    request_id: str
    error: str | None = None


@dataclass(slots=True)
class _RemoteDone:
    request_id: str
    result: RemoteResult


@dataclass(slots=True)
class _Release:
    request_id: str


T = TypeVar("T")


@dataclass(slots=True)
class _Call(Generic[T]):
    fn: Callable[[LLMEngine], T]
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future[T]

    def run(self, engine: LLMEngine) -> None:
        try:
            result: Any = self.fn(engine)
            self.loop.call_soon_threadsafe(_resolve, self.fut, result, None)
        except Exception as e:
            self.loop.call_soon_threadsafe(_resolve, self.fut, None, e)


def _resolve(fut: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


_Cmd = _Add | _Abort | _RemoteDone | _Release | _Call[Any]


_Item = RequestOutput | RemoteAlloc | Exception
_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[_Item]"]


def _put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncLLM:
    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None,
                 offload: KVOffload | None = None, handoff: KVHandoff | None = None) -> None:
        """`handoff`: the hand-off connector requests with `kv_params` go through (may
        be set later, once it has registered the KV cache)."""
        self.engine = LLMEngine(config, kv_cache, offload)
        self.handoff = handoff
        self.tokenizer = self.engine.tokenizer
        self._cmds: queue.SimpleQueue[_Cmd | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stats = self.engine.stats()
        self._dead: BaseException | None = None
        self._kv_sinks: list[Callable[[list[KVEvent]], None]] = []
        self._step_sink: Callable[[int], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       priority: int = 0, kv_params: Any = None,
                       hold_kv: bool = False, resume_token_ids: Sequence[int] = (),
                       tenant: str = "", labels: Mapping[str, str] | None = None,
                       client_id: str = "") -> AsyncGenerator[RequestOutput, None]:
        """Yields outputs until one is finished. Raises RequestError (bad request,
        before any work) or EngineDeadError. Leaving the iteration early (client gone,
        task cancelled) aborts the request, cancels its remote prefill and frees its
        blocks.

        `kv_params`: prefill elsewhere, through `handoff` (ignored without one). The
        engine allocates blocks for the prompt (after local prefix hits) and awaits
        `handoff.fill(alloc, kv_params)` in this event loop; if the blocks are not free
        now, the request simply prefills locally.
        `hold_kv`: a producer; outputs report KV progress every step and the blocks
        stay held after the request finishes, until `release(request_id)`.
        `resume_token_ids`: fail-over; output tokens another worker already streamed
        (see LLMEngine.add_request). Outputs count them but never repeat them.
        `tenant`, `labels`, `client_id` (the client's request id): who sent it, which
        selects the scheduling strategies that apply (engine/strategies.py).
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead}")
        if params.structured is not None:
            # A grammar compiles off the event loop (milliseconds to seconds, first time
            # per schema); validate below then finds it cached, or raises its error.
            with contextlib.suppress(ValueError):
                await asyncio.to_thread(self.engine.structured.compile, params.structured)
        params = replace(params)  # the engine's own, validated once (bad words tokenized)
        self.engine.validate(prompt_token_ids, params, resume_token_ids)
        handoff = self.handoff if kv_params is not None else None
        q: asyncio.Queue[_Item] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._cmds.put(_Add(request_id, list(prompt_token_ids), params, cache_salt,
                            priority, remote=handoff is not None, hold_kv=hold_kv,
                            resume=list(resume_token_ids), tenant=tenant,
                            labels=dict(labels or {}), client_id=client_id))
        finished = False
        task: asyncio.Task[None] | None = None
        try:
            while True:
                item = await q.get()
                if isinstance(item, RemoteAlloc):
                    assert handoff is not None
                    task = asyncio.create_task(self._run_remote(handoff, item, kv_params))
                    continue
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if task is not None and not task.done():
                task.cancel()
            if not finished:
                self.abort(request_id)

    async def _run_remote(self, handoff: KVHandoff, alloc: RemoteAlloc,
                          kv_params: Any) -> None:
        try:
            result = await handoff.fill(alloc, kv_params)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the `fail` policy: end the request with the reason
            log.warning("remote prefill of %s failed: %s", alloc.request_id, e)
            self._cmds.put(_Abort(alloc.request_id, error=f"remote prefill failed: {e}"))
            return
        self._cmds.put(_RemoteDone(alloc.request_id, result))

    def release(self, request_id: str) -> None:
        """Frees the blocks a finished `hold_kv` request kept for sending."""
        self._cmds.put(_Release(request_id))

    def abort(self, request_id: str) -> None:
        """Asks the loop to end the request and free its blocks (no-op if finished)."""
        self._cmds.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps (for reads that must
        be consistent, e.g. `check_integrity` in tests)."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._cmds.put(_Call(fn, asyncio.get_running_loop(), fut))
        return await fut

    def set_kv_event_sink(self, sink: Callable[[list[KVEvent]], None] | None) -> None:
        """`sink(events)` receives the block pool's BlockStored/BlockRemoved events after
        every step, on the engine thread (so it must be quick and thread-safe). Without a
        sink the events are dropped. For consistent snapshots, read the pool with `call`."""
        self._kv_sinks = [] if sink is None else [sink]

    def add_kv_event_sink(self, sink: Callable[[list[KVEvent]], None]) -> None:
        """Another sink beside the first (as `set_kv_event_sink`); each gets every event."""
        self._kv_sinks = [*self._kv_sinks, sink]

    def set_step_sink(self, sink: Callable[[int], None] | None) -> None:
        """`sink(num_tokens)` after every step that computed tokens (prompt and output
        tokens together), on the engine thread: it must be quick and thread-safe."""
        self._step_sink = sink

    def stats(self) -> SchedulerStats:
        """The scheduler's figures as of the end of the last step."""
        return self._stats

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._cmds.put(None)
        self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------
    def _deliver(self, request_id: str, item: _Item, last: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if last \
                else self._streams.get(request_id)
        if stream is None:
            return
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def _deliver_step(self, outs: list[RequestOutput]) -> None:
        """A step's outputs: one wake-up per event loop for all of them (each
        `call_soon_threadsafe` writes to the loop's self-pipe, a system call)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
        with self._lock:
            for out in outs:
                stream = self._streams.pop(out.request_id, None) if out.finished \
                    else self._streams.get(out.request_id)
                if stream is not None:
                    batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    def _apply(self, cmd: _Cmd) -> None:
        eng = self.engine
        if isinstance(cmd, _Abort):
            out = eng.abort(cmd.request_id, cmd.error)
            if out is not None:
                self._deliver(cmd.request_id, out, last=True)
        elif isinstance(cmd, _RemoteDone):
            r = cmd.result
            for out in eng.finish_remote(cmd.request_id, r.first_token, r.num_computed_tokens,
                                         r.samples, r.prompt_logprobs):
                self._deliver(out.request_id, out, last=out.finished)
        elif isinstance(cmd, _Release):
            eng.release(cmd.request_id)
        elif isinstance(cmd, _Call):
            cmd.run(eng)
        else:
            self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        args = (cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.cache_salt, cmd.priority)
        try:
            alloc = self.engine.add_remote_request(
                *args, resume_token_ids=cmd.resume, tenant=cmd.tenant, labels=cmd.labels,
                client_id=cmd.client_id) if cmd.remote else None
            if alloc is not None:
                self._deliver(cmd.request_id, alloc, last=False)
            else:
                self.engine.add_request(*args, hold_kv=cmd.hold_kv,
                                        resume_token_ids=cmd.resume, tenant=cmd.tenant,
                                        labels=cmd.labels, client_id=cmd.client_id)
        except RequestError as e:
            self._deliver(cmd.request_id, e, last=True)

    def _forward_kv_events(self) -> None:
        events = self.engine.kv.pool.take_events()
        for sink in self._kv_sinks if events else ():
            try:
                sink(events)
            except Exception:  # the index is advisory: never let it stop the engine
                log.exception("kv event sink failed")

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_work()
                try:
                    cmd = self._cmds.get(block=block, timeout=None)
                    while True:
                        if cmd is None:
                            return
                        self._apply(cmd)
                        cmd = self._cmds.get_nowait()
                except queue.Empty:
                    pass
                outputs = self.engine.step()
                # The figures first: a client that has its last token sees its request
                # gone from them (the metrics a router scores, `num_active` callers).
                self._stats = self.engine.stats()
                self._deliver_step(outputs)
                step_sink = self._step_sink
                if step_sink is not None and self.engine.last_step_tokens:
                    step_sink(self.engine.last_step_tokens)
                self._forward_kv_events()
        except BaseException as e:  # a bug in the engine: fail every stream loudly
            log.exception("engine loop crashed")
            self._dead = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine loop crashed: {e!r}"), last=True)
