"""Async streaming front of the engine, for services: add a request and iterate its
outputs, abort it, read load stats.

The engine loop runs in one background thread (torch releases the GIL in its kernels,
so the asyncio loop stays responsive); commands cross into it through a queue and
outputs come back through `call_soon_threadsafe` into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerStats

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can run."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int


@dataclass(slots=True)
class _Abort:
    request_id: str


_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | Exception]"]


class AsyncLLM:
    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None) -> None:
        self.engine = LLMEngine(config, kv_cache)
        self.tokenizer = self.engine.tokenizer
        self._cmds: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stats = self.engine.stats()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields outputs until one is finished. Raises RequestError (bad request,
        before any work) or EngineDeadError. Leaving the iteration early (client gone,
        task cancelled) aborts the request and frees its blocks."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead}")
        self.engine.validate(prompt_token_ids, params)
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._cmds.put(_Add(request_id, list(prompt_token_ids), replace(params), cache_salt,
                            priority))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Asks the loop to end the request and free its blocks (no-op if finished)."""
        self._cmds.put(_Abort(request_id))

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
    def _deliver(self, request_id: str, item: RequestOutput | Exception, last: bool) -> None:
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

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            out = self.engine.abort(cmd.request_id)
            if out is not None:
                self._deliver(cmd.request_id, out, last=True)
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    cmd.cache_salt, cmd.priority)
        except RequestError as e:
            self._deliver(cmd.request_id, e, last=True)

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
                for out in self.engine.step():
                    self._deliver(out.request_id, out, last=out.finished)
                self._stats = self.engine.stats()
        except BaseException as e:  # a bug in the engine: fail every stream loudly
            log.exception("engine loop crashed")
            self._dead = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine loop crashed: {e!r}"), last=True)
