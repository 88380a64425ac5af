"""`splitserve.v1.Worker` on one AsyncLLM: Generate (stream), Load (stream), Info.

Ownership: the service borrows the AsyncLLM (worker/server.py owns and shuts it down).
Each Generate call owns its engine request: when the call ends early (client cancel,
deadline, drain) the engine stream is closed, which aborts the request and frees its
blocks.

Disaggregation (role "decode"): a request whose gateway named peers runs with
`kv_params`: the engine allocates the prompt's blocks (after local prefix hits) and its
hand-off connector has the peers write straight into them over kvtransfer; the request
becomes runnable when every block has landed verified. On failure the policy recomputes
locally or fails the request (worker/handoff.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import grpc

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.llm_engine import RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from kvtransfer.wire import deadline
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.convert import logprobs_to_proto, request_id_from, sampling_from_proto
from worker.config import WorkerConfig
from worker.handoff import HandoffParams
from worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from worker.kv_source import KVSource

log = logging.getLogger(__name__)


def _first_token_timings(start: float, scheduled: float | None, first: float,
                         remote: dict[str, float]) -> pb.FirstTokenTimings:
    """The worker's share of a first token (monotonic seconds in): computed here, the
    queue before scheduling and the prefill after; filled remotely, the prefill peer's
    compute, the rest of the fill as KV transfer, and the remainder as queue."""
    total = first - start
    if "remote_s" in remote:
        prefill = min(remote.get("prefill_s", 0.0), remote["remote_s"])
        return pb.FirstTokenTimings(worker_queue_s=max(total - remote["remote_s"], 0.0),
                                    prefill_s=prefill,
                                    kv_transfer_s=remote["remote_s"] - prefill)
    queue = max((scheduled or start) - start, 0.0)
    return pb.FirstTokenTimings(worker_queue_s=queue, prefill_s=max(total - queue, 0.0))


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics, kv_layout: str) -> None:
        self.config = config
        self.metrics = metrics
        self.kv_layout = kv_layout
        self.llm: AsyncLLM | None = None  # set by attach() once the model is loaded
        self.draining = False
        self.stopping = False  # set just before the server stops: Load streams end
        # Set by worker/server.py before readiness: the address of the receiver prefill
        # peers write into on a decode worker (Info and registration report it).
        self.kv_source: KVSource | None = None  # serves FetchKV (workers with a transport)
        self.transport_address = ""
        self.changed = asyncio.Event()  # poked on request start/end: load reports follow

    def attach(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.changed.set()

    # -- Generate ---------------------------------------------------------------------
    async def Generate(self, request: pb.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[
                           pb.WorkerGenerateResponse]:
        llm = self.llm
        if self.config.role == "prefill":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "a prefill worker serves splitserve.v1.Prefill, not Generate")
            return
        if llm is None or self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "worker is draining" if self.draining else "model not loaded")
            return
        rid = request.request_id or request_id_from(context, uuid.uuid4().hex)
        # a stream needs each step's new tokens only (no copy of the whole output per step)
        params = replace(sampling_from_proto(request.sampling),
                         output_kind=RequestOutputKind.DELTA)
        peer = request.prefill_peer if request.HasField("prefill_peer") else None
        n_prompt = len(request.prompt_token_ids)
        start = last = time.monotonic()
        scheduled: float | None = None  # first scheduled here (None: not yet, or remote)
        first: float | None = None  # the first token's arrival
        remote_timings: dict[str, float] = {}  # a remote fill's (see _run)
        n_out = 0
        ended = False  # finished, rejected or failed: anything else is a client abort
        self.changed.set()
        try:
            left = context.time_remaining()
            deadline = None if left is None else time.monotonic() + left
            async with contextlib.aclosing(self._run(request, params, peer, deadline,
                                                     remote_timings)) as outs:
                async for out in outs:
                    now = time.monotonic()
                    if scheduled is None and out.scheduled_time is not None:
                        scheduled = out.scheduled_time
                    resp = self._response(rid, out, n_prompt, params)
                    if out.new_token_ids:
                        self._observe_tokens(request.tenant, start, last, now, n_out,
                                             len(out.new_token_ids), out.scheduled_time)
                        last = now
                        if first is None:
                            first = now
                            resp.first_token_timings.CopyFrom(_first_token_timings(
                                start, scheduled, now, remote_timings))
                    n_out = out.num_output_tokens
                    if out.finished:
                        ended = True
                        self.metrics.observe_finished(out.finish_reason or "stop", n_prompt,
                                                      n_out, request.tenant)
                        if first is not None:
                            self.metrics.observe_phases(scheduled or start, first, last,
                                                        n_out, request.tenant)
                        log.info("event=finished request_id=%s reason=%s prompt_tokens=%d "
                                 "output_tokens=%d", rid, out.finish_reason, n_prompt, n_out)
                    yield resp
        except RequestError as e:
            ended = True
            log.info("event=rejected request_id=%s message=%r", rid, str(e))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            ended = True
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            # Client cancel or deadline. gRPC either cancels this task or stops
            # iterating and closes the generator; either way the engine stream was
            # closed above (request aborted, blocks freed).
            if not ended:
                log.info("event=cancelled request_id=%s output_tokens=%d", rid, n_out)
                self.metrics.observe_finished("abort", n_prompt, n_out, request.tenant)
            self.changed.set()

    def _observe_tokens(self, tenant: str, start: float, last: float, now: float,
                        n_before: int, n_new: int, scheduled: float | None) -> None:
        m, model = self.metrics, self.metrics.model
        if n_before == 0:
            m.ttft.labels(model, tenant).observe(now - start)
            if scheduled is not None:  # None: the first token came from a remote prefill
                m.queue_time.labels(model, tenant).observe(max(scheduled - start, 0.0))
            n_new -= 1
        for _ in range(n_new):  # tokens that arrived together share the interval
            m.itl.labels(model, tenant).observe((now - last) / n_new)

    def _run(self, request: pb.WorkerGenerateRequest, params: SamplingParams,
             prefill_peer: pb.PrefillPeer | None, deadline: float | None = None,
             timings: dict[str, float] | None = None,
             ) -> AsyncGenerator[RequestOutput, None]:
        """The engine outputs for one request. On a decode worker the prompt's KV comes
        from the peers the gateway named (blocks pulled from `kv_peer`, the rest pushed by
        `prefill_peer`) through the engine's hand-off connector (worker/handoff.py);
        otherwise it is computed here. Closing the returned iterator aborts the request,
        cancels its remote fill and frees its KV."""
        assert self.llm is not None  # Generate checked
        kv_params: HandoffParams | None = None
        kv_peer = request.kv_peer if request.HasField("kv_peer") else None
        resume = list(request.resume_token_ids)
        if resume and prefill_peer is not None:
            # A prefill samples the first output token, which a resumed request has:
            # its KV (prompt + resumed tokens) comes from a kv peer or is computed here.
            prefill_peer = None
        if self.llm.handoff is not None and ((prefill_peer and prefill_peer.address)
                                             or (kv_peer and kv_peer.address)):
            kv_params = HandoffParams(request, prefill_peer, kv_peer, deadline,
                                      timings if timings is not None else {})
        elif prefill_peer is not None or kv_peer is not None:
            log.debug("request %s: peers ignored by a %s worker", request.request_id,
                      self.config.role)
        return cast(AsyncGenerator[RequestOutput, None], self.llm.generate(
            request.request_id, list(request.prompt_token_ids), params,
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            priority=request.priority, kv_params=kv_params, resume_token_ids=resume,
            tenant=request.tenant, labels=dict(request.labels),
            client_id=request.client_request_id))

    @staticmethod
    def _response(rid: str, out: RequestOutput, n_prompt: int,
                  params: SamplingParams) -> pb.WorkerGenerateResponse:
        """One delta of sample `out.index` (a DELTA output): its new tokens with their
        logprobs; the prompt's logprobs with a sample's first tokens; its end
        (finish_reason, cumulative_logprob) on its last."""
        new = out.new_token_ids
        resp = pb.WorkerGenerateResponse(
            request_id=rid, token_ids=new, text=out.new_text,
            finish_reason=out.finish_reason or "", index=out.index,
            num_prompt_tokens=n_prompt, num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens, error=out.error or "",
            cumulative_logprob=out.cumulative_logprob)
        if isinstance(out.stop_reason, str):
            resp.stop_str = out.stop_reason
        elif out.stop_reason is not None:
            resp.stop_token_id = out.stop_reason
        if out.logprobs is not None and params.logprobs is not None and new:
            resp.logprobs.extend(logprobs_to_proto(out.logprobs, new, params.logprobs))
        if out.prompt_logprobs is not None and params.prompt_logprobs is not None \
                and len(new) == out.num_output_tokens and new:
            # prompt tokens 1..N-1: the chosen token is the prompt's own
            resp.prompt_logprobs.extend(logprobs_to_proto(
                out.prompt_logprobs, [next(iter(lp)) for lp in out.prompt_logprobs],
                params.prompt_logprobs))
        return resp

    # -- FetchKV (peer fetch, holder side) ---------------------------------------------
    async def FetchKV(self, request: pb.FetchKVRequest,
                      context: grpc.aio.ServicerContext) -> pb.FetchKVResponse:
        if self.kv_source is None or self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "this worker serves no KV to peers (colocated, loading or "
                                "draining)")
            raise AssertionError("unreachable")
        return await self.kv_source.fetch(request, context)

    # -- Load ------------------------------------------------------------------------
    def load_report(self) -> pb.LoadReport:
        rep = pb.LoadReport(worker_id=self.config.worker_id,
                            ready=self.llm is not None and not self.draining)
        if self.llm is not None:
            s = self.llm.stats()
            rep.num_waiting = s.num_waiting
            rep.num_running = s.num_running
            rep.kv_usage = s.kv_usage
            rep.num_free_blocks = s.num_free_blocks
            rep.num_blocks = s.num_blocks
            rep.num_active = self.llm.num_active
            rep.prefix_cache_queries = s.prefix_cache_queries
            rep.prefix_cache_hits = s.prefix_cache_hits
        return rep

    async def Load(self, request: pb.LoadRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoadReport]:
        """A report when the figures change (at most one per interval) and at least one
        per keepalive period, until the client leaves or the server stops."""
        interval = (request.min_interval_ms or self.config.load_interval_ms) / 1000.0
        last_key: Any = None
        last_sent = 0.0
        while True:
            rep = self.load_report()
            key = rep.SerializeToString()
            now = time.monotonic()
            if key != last_key or now - last_sent >= self.config.load_keepalive_s:
                yield rep
                last_key, last_sent = key, now
            if self.stopping:
                return
            self.changed.clear()
            # Wake on a request start/end or after the interval; the engine's own
            # progress (blocks freed as decoding ends) shows up on the next tick.
            with contextlib.suppress(TimeoutError):
                async with deadline(interval):  # (wait_for may swallow a cancel)
                    await self.changed.wait()
            await asyncio.sleep(interval / 4)

    # -- Info ------------------------------------------------------------------------
    async def Info(self, request: pb.InfoRequest,
                   context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        llm = self.llm
        if llm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model not loaded")
            raise AssertionError("unreachable")  # abort raises
        eng = llm.engine
        return pb.InfoResponse(
            worker_id=self.config.worker_id, model_id=eng.model_id, role=self.config.role,
            max_model_len=eng.max_model_len, block_size=eng.block_size,
            kv_layout=self.kv_layout, transport_address=self.transport_address,
            num_blocks=llm.stats().num_blocks, vocab_size=eng.model_config.vocab_size)
