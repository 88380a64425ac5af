"""The prefill side of the hand-off connector (`worker/handoff.py`): splitserve.v1.Prefill.

The prompt runs as a producer (`hold_kv`, max_tokens 1), so each chunked-prefill step
reports which blocks are complete; one writer task per call begins the transfer at once
(an in-place transport's write grant, beside the first chunk's compute) and pushes them
into the decode's blocks while the engine computes the next chunk. On CUDA each step's
output carries the event recorded after its forward (`kv_ready`) and the write waits on
that event, not on the forwards queued after it, so chunk c's copy overlaps chunk c+1's
forward. At the end the last (partial) block goes too, the receiver's verdict is
awaited, the held blocks are released and the first token is returned. A cancelled call
cancels its writes, fences the transfer on the receiver and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc

from engine.async_llm import AsyncLLM
from engine.kv_scales import wire_scales
from engine.llm_engine import RequestError
from engine.outputs import RequestOutput
from kvtransfer.base import KVSender
from kvtransfer.errors import KVTransferError
from kvtransfer.layout import KVLayout, whole_blocks
from kvtransfer.pusher import KVPusher
from kvtransfer.sender import Peer
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.convert import logprobs_to_proto, request_id_from, sampling_from_proto

if TYPE_CHECKING:
    from worker.service import WorkerService

log = logging.getLogger(__name__)

# (source blocks here, destination blocks there, the event after the forward that
# computed them: `RequestOutput.kv_ready`, None on CPU)
_Batch = tuple[list[int], list[int], Any]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefillSide(pb_grpc.PrefillServicer):
    """`Prefill` of a prefill worker's connector: `worker` runs the prompt, `pusher`
    (set once the KV cache exists) sends its blocks."""

    worker: WorkerService
    pusher: KVPusher | None

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        llm = self.worker.llm
        if llm is None or self.worker.draining or self.pusher is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker not ready")
            raise AssertionError("unreachable")
        rid = request.request_id or request_id_from(context, "")
        error = self._check(request, llm)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        t0 = time.monotonic()
        try:
            peer = await self.pusher.peer(request.dest.transport_address)
            resp = await self._prefill(llm, self.pusher.sender, peer, rid, request, context)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            log.warning("request %s: KV transfer to %s failed: %s", rid,
                        request.dest.worker_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        log.info("request %s prefilled in %.3fs: %d blocks to %s", rid, time.monotonic() - t0,
                 resp.num_blocks_written, request.dest.worker_id)
        return resp

    @staticmethod
    def _check(request: pb.PrefillRequest, llm: AsyncLLM) -> str:
        bs = llm.engine.block_size
        n = len(request.token_ids)
        d = request.dest
        if not d.transport_address:
            return "dest.transport_address is required"
        if len(d.block_ids) != cdiv(n, bs):
            return f"dest holds {len(d.block_ids)} blocks; a {n}-token prompt needs {cdiv(n, bs)}"
        if d.num_computed_tokens % bs or d.num_computed_tokens >= max(n, 1):
            return "dest.num_computed_tokens must be block aligned and below the prompt length"
        return ""

    async def _prefill(self, llm: AsyncLLM, sender: KVSender, peer: Peer, rid: str,
                       request: pb.PrefillRequest,
                       context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        dest, bs = request.dest, llm.engine.block_size
        gen = int(dest.generation)
        # Every sample's first token is drawn here, from this one prefill (n / best_of;
        # best_of ranks on logprobs, so they come back); the rest is the decode's.
        asked = sampling_from_proto(request.sampling)
        k = 0 if asked.logprobs is None and asked.num_samples > asked.n else asked.logprobs
        params = replace(asked, max_tokens=1, stop=[], min_tokens=min(asked.min_tokens, 1),
                         n=asked.num_samples, best_of=None, logprobs=k)
        firsts: dict[int, RequestOutput] = {}  # sample index -> its (only) output
        queue: asyncio.Queue[_Batch | None] = asyncio.Queue()
        sent = dest.num_computed_tokens // bs
        # the grant's round trip (in-place transports) runs beside the first chunk's compute
        writer = asyncio.create_task(self._write_loop(
            sender, peer, rid, gen, queue, list(dest.block_ids[sent:]),
            self.pusher.stage if self.pusher else None))
        # A writer that fails (a begin refused or timed out, a write failed) stops the
        # compute at once, not after the whole prompt: its error is the call's.
        me, computing = asyncio.current_task(), True
        writer.add_done_callback(lambda t: me.cancel() if computing and me is not None
                                 and not t.cancelled() and t.exception() is not None
                                 else None)
        pid = f"prefill-{rid}"
        final: RequestOutput | None = None
        t_first_write: float | None = None
        t0 = time.monotonic()
        try:
            async with contextlib.aclosing(llm.generate(
                    pid, list(request.token_ids), params, hold_kv=True,
                    cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
                    priority=request.priority, tenant=request.tenant,
                    labels=dict(request.labels), client_id=request.client_request_id,
            )) as outs:
                async for out in outs:
                    if out.finish_reason is not None:
                        firsts[out.index] = out
                    if out.block_ids is None:
                        continue  # a forked sample: only sample 0 (the producer) holds KV
                    # Full blocks are final once computed; the last one only at the end.
                    done = cdiv(out.num_computed_tokens, bs) if out.finish_reason \
                        else out.num_computed_tokens // bs
                    if done > sent:
                        t_first_write = t_first_write or time.monotonic()
                        queue.put_nowait((out.block_ids[sent:done],
                                          list(dest.block_ids[sent:done]), out.kv_ready))
                        sent = done
            computing = False
            final = firsts.get(0)
            t_compute = time.monotonic()
            if final is None or final.finish_reason == "error" or not final.token_ids:
                raise RequestError(f"prefill did not produce a token: "
                                   f"{final.error if final else 'aborted'}")
            queue.put_nowait(None)
            await writer  # raises the transfer's first error
            remaining = context.time_remaining()
            await sender.finish(peer, rid, gen, timeout_s=remaining if remaining else None)
        except BaseException as e:
            computing = False
            failed = writer.done() and not writer.cancelled() and writer.exception()
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
            with contextlib.suppress(Exception):
                await asyncio.shield(sender.cancel(peer, rid, gen, "prefill aborted"))
            if isinstance(e, asyncio.CancelledError) and failed and me is not None \
                    and me.uncancel() == 0:  # cancelled by the writer's failure alone
                raise failed from None
            raise
        finally:
            llm.release(pid)  # no-op when the request was aborted (its blocks are freed)
        t_end = time.monotonic()
        n_written = sent - dest.num_computed_tokens // bs
        kv_scales = await llm.call(lambda eng: wire_scales(eng.runner))
        samples = [firsts[i] for i in sorted(firsts)]
        return pb.PrefillResponse(
            request_id=rid, first_token=final.token_ids[0],
            first_tokens=[o.token_ids[0] for o in samples if o.token_ids],
            first_logprobs=[lp for o in samples if o.token_ids and o.logprobs and k is not None
                            for lp in logprobs_to_proto(o.logprobs[:1], o.token_ids[:1], k)],
            prompt_logprobs=logprobs_to_proto(
                final.prompt_logprobs, request.token_ids[1:], asked.prompt_logprobs or 0)
            if final.prompt_logprobs else [],
            num_cached_tokens=final.num_cached_tokens, num_blocks_written=n_written,
            kv_scales=kv_scales,
            timings=pb.PrefillTimings(
                queue_s=0.0, compute_s=t_compute - t0,
                transfer_s=t_end - (t_first_write or t_end),
                bytes_sent=n_written * KVLayout.from_json(self.worker.kv_layout).block_bytes))

    @staticmethod
    async def _write_loop(sender: KVSender, peer: Peer, rid: str, gen: int,
                          queue: asyncio.Queue[_Batch | None], dst: list[int],
                          stage: Callable[[list[int]], Awaitable[None]] | None = None,
                          ) -> None:
        """Begins the transfer into `dst` (its whole destination), then writes batches in
        order until None (each staged first when the pusher stages: TP's gather)."""
        await sender.begin(peer, whole_blocks(dst), rid, gen)
        while (batch := await queue.get()) is not None:
            src, chunk_dst, ready = batch
            if stage is not None:
                await stage(src)
            await sender.write(peer, whole_blocks(src), whole_blocks(chunk_dst), rid, gen,
                               ready=ready)
